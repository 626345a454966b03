"""The whole-config check: one path, run by ``load_config`` and again first thing in ``train()`` (a Config
built in code never passes through ``load_config``). It is cheap and idempotent, so running it twice on a
loaded config is fine.

In order: the range checks below, the options set while their method is off (``_GATED``), the algorithm
section's own checks (``algorithms/resolve.check_algorithm``: registry names and ``check_ranges``, which
before ran only when train() resolved the algorithm), then each method's whole-config check from the
declarative ``_METHOD_CHECKS`` table, imported only when its method is on so that heavy modules stay
unimported on the default path. ``check_algorithm`` also runs ``_GATED``'s algorithm entries itself, so that
``resolve_algorithm`` called on an AlgorithmConfig alone refuses the same options. Warnings are printed once per
config object (a loaded config checked again by train() does not repeat them; another config does)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

from anabranch.config import Config, ConfigError
from anabranch.range_checks import first_failed_key


def check_whole_config(cfg: Config) -> None:
    """Refuse, before any model loads, every setting or combination that cannot work."""
    caller = cfg  # the object the warnings are remembered on (_first_time), not the resolved copy below
    if not (cfg.algorithm.advantage and cfg.algorithm.loss):
        # A Config built in code may name only the recipe (algorithm.name): check what will run, as
        # resolve_algorithm does, without changing the caller's config.
        from anabranch.algorithms.resolve import apply_recipe

        cfg = dataclasses.replace(cfg, algorithm=apply_recipe(cfg.algorithm))
    if (error := first_failed_key(_range_checks(cfg), cfg)) is not None:
        raise ConfigError(error)
    _refuse_inactive(cfg)
    from anabranch.algorithms.resolve import check_algorithm

    check_algorithm(cfg.algorithm)
    for check in _METHOD_CHECKS:
        if check.on(cfg):
            module, _, name = check.target.partition(":")
            error = getattr(importlib.import_module(module), name)(check.arg(cfg))
            if isinstance(error, str):  # the checks raise, or return the refusal's text (or None, or a value)
                raise ConfigError(error)
    for on, warning in _WARNINGS:
        if on(cfg) and (text := warning(cfg)) is not None and _first_time(caller, text):
            from anabranch.rewards.guard import warn

            warn(text)


def _first_time(cfg: Config, text: str) -> bool:
    """True the first time ``text`` is warned about for this config object: a loaded config is checked again by
    train(), which must not repeat the load's warning, but another config in the same process (eval/compare.py's
    runs, a sweep) warns again. The texts live on the object itself (not a dataclass field: asdict, the saved
    config.yaml and == ignore it), so nothing is kept after the config is gone and an id is never reused."""
    seen = vars(cfg).setdefault(_WARNED_ATTR, set())
    if text in seen:
        return False
    seen.add(text)
    return True


def _range_checks(cfg: Config) -> list:
    """(holds, dotted key, what it must be): ranges and cheap combinations that need no imports."""
    checks = [
        (cfg.trainer.lr > 0, "trainer.lr", "must be positive"),
        (cfg.trainer.steps >= 0, "trainer.steps", "must be >= 0"),
        (cfg.trainer.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1"),
        (cfg.trainer.micro_batch_tokens >= -1, "trainer.micro_batch_tokens",
         "must be > 0 (a token budget), 0 (rows of trainer.micro_batch_size) or -1 (auto)"),
        (cfg.rollout.n >= 1, "rollout.n", "must be >= 1"),
        (cfg.rollout.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1"),
        (cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0"),
        (cfg.rollout.temperature > 0 or cfg.rollout.n == 1, "rollout.temperature",
         f"=0 decodes greedily, so the rollout.n={cfg.rollout.n} samples of a prompt would be identical "
         "(equal rewards: zero group advantages, nothing to learn); set rollout.temperature > 0 or rollout.n=1"),
        (not cfg.algorithm.dynamic_sampling or cfg.rollout.n >= 2, "algorithm.dynamic_sampling",
         "needs rollout.n >= 2: it keeps groups whose samples disagree, and a group of one never does, so "
         "every round would be dropped"),
        # DARS (trainer/extra_rollouts.py): its knobs' ranges; its refused combinations in check_config
        (cfg.rollout.extra_rollouts in ("none", "dars", "cure"), "rollout.extra_rollouts", "must be none, dars or cure"),
        (cfg.rollout.dars_schedule in ("equal", "hardness", "fixed"), "rollout.dars_schedule",
         "must be equal, hardness or fixed"),
        (cfg.rollout.dars_max_extra >= 1, "rollout.dars_max_extra", "must be >= 1 (the most extra samples a prompt gets)"),
        (0 < cfg.rollout.dars_threshold <= 1, "rollout.dars_threshold",
         "must be in (0, 1]: prompts whose accuracy is strictly below it get extra samples"),
        (cfg.rollout.extra_rollouts != "dars" or cfg.rollout.n >= 2, "rollout.extra_rollouts",
         "=dars needs rollout.n >= 2: the first samples estimate each prompt's accuracy"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]"),
        (cfg.task.eval_size >= 0, "task.eval_size", "must be >= 0"),
        (cfg.task.train_size >= 1, "task.train_size", "must be >= 1"),
        (cfg.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
         "must be one of float32, bfloat16, float16"),
        (cfg.algorithm.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1"),
        (cfg.algorithm.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0"),
        (cfg.trainer.collapse_margin > 0, "trainer.collapse_margin", "must be > 0"),
        (cfg.reward.timeout_s > 0, "reward.timeout_s", "must be positive"),
        (cfg.reward.isolation in ("process", "thread", "none"), "reward.isolation",
         "must be one of process, thread, none"),
        (cfg.model.lora.r >= 0, "model.lora.r", "must be >= 0 (0 disables LoRA)"),
        (cfg.distributed.num_processes >= 1, "distributed.num_processes", "must be >= 1"),
        (cfg.distributed.mixed_precision in ("no", "bf16", "fp16"), "distributed.mixed_precision",
         "must be one of no, bf16, fp16"),
        (cfg.rollout.vllm_dtype in ("auto", "float32", "bfloat16", "float16"), "rollout.vllm_dtype",
         "must be one of auto, float32, bfloat16, float16"),
        (cfg.rollout.vllm_cpu_kv_cache_mib >= 0, "rollout.vllm_cpu_kv_cache_mib",
         "must be >= 0 (0 sizes the cache for the run)"),
        (len(cfg.reward.functions) >= 1, "reward.functions", "needs at least one reward function"),
        (cfg.trainer.keep_last >= 0, "trainer.keep_last", "must be >= 0 (0 keeps every checkpoint)"),
        (cfg.trainer.max_nonfinite_in_a_row >= 1, "trainer.max_nonfinite_in_a_row", "must be >= 1"),
        (cfg.trainer.save_every >= 0, "trainer.save_every", "must be >= 0 (0: no periodic checkpoints)"),
        (cfg.rollout.top_k >= 0, "rollout.top_k", "must be >= 0 (0 turns top-k off)"),
        # EAD (rollout/temperature_schedule.py): the hf sampler applies τ_t itself and records the
        # tempered log-probs; vLLM has no per-position temperature, and a base temperature or a
        # top-k / top-p filter would make the recorded log-probs differ from the sampled distribution.
        (cfg.rollout.temperature_schedule in ("constant", "ead"), "rollout.temperature_schedule",
         "must be constant or ead"),
        (cfg.rollout.temperature_schedule != "ead" or cfg.rollout.backend == "hf", "rollout.backend",
         "must be hf with rollout.temperature_schedule=ead: vLLM's sampling parameters have no "
         "per-position temperature"),
        (cfg.rollout.temperature_schedule != "ead" or cfg.rollout.temperature == 1.0, "rollout.temperature",
         "must be 1.0 with rollout.temperature_schedule=ead: the schedule sets each token's temperature "
         "and the trainer's target policy is π_θ at temperature 1"),
        (cfg.rollout.temperature_schedule != "ead" or (cfg.rollout.top_k == 0 and cfg.rollout.top_p == 1.0),
         "rollout.top_k", "must be 0 and rollout.top_p 1.0 with rollout.temperature_schedule=ead (the "
         "paper samples the full tempered distribution, whose log-probs the sampler records)"),
        (cfg.rollout.ead_tau_min > 0, "rollout.ead_tau_min", "must be > 0"),
        (cfg.rollout.ead_tau_max >= cfg.rollout.ead_tau_min, "rollout.ead_tau_max",
         "must be >= rollout.ead_tau_min"),
        (cfg.rollout.ead_decay > 0, "rollout.ead_decay", "must be > 0 (d_0 of τ_t = max(1 + τ_max − e^(t/d), τ_min))"),
        (cfg.rollout.ead_decay_growth >= 0, "rollout.ead_decay_growth", "must be >= 0"),
        (cfg.rollout.ead_decay_max >= cfg.rollout.ead_decay, "rollout.ead_decay_max", "must be >= rollout.ead_decay"),
        (cfg.rollout.ead_warmup_tokens >= 0, "rollout.ead_warmup_tokens", "must be >= 0"),
        (cfg.rollout.max_tool_calls >= 1, "rollout.max_tool_calls", "must be >= 1"),
        (cfg.rollout.tool_output_max_tokens >= 1, "rollout.tool_output_max_tokens", "must be >= 1"),
        (cfg.rollout.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0"),
        (cfg.rollout.retry_turns >= 0, "rollout.retry_turns", "must be >= 0 (0 or 1: one attempt; K >= 2 attempts)"),
        (cfg.rollout.max_env_turns >= 1, "rollout.max_env_turns", "must be >= 1 (actions per episode)"),
        (not cfg.rollout.void_turn_filter or bool(cfg.rollout.tools), "rollout.void_turn_filter",
         "needs rollout.tools: a void turn is a turn between tool results with neither a tool call nor a "
         "final answer, and a single-turn response has no tool calls to filter on; set rollout.tools or "
         "rollout.void_turn_filter=false"),
        (not cfg.rollout.tools or cfg.rollout.min_new_tokens == 0, "rollout.min_new_tokens",
         "must be 0 with rollout.tools: a response's length is its turns' and its tool outputs' together, "
         "so a minimum per generate call has no fixed meaning"),
        (0 <= cfg.rollout.min_new_tokens <= cfg.rollout.max_new_tokens, "rollout.min_new_tokens",
         f"must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}]"),
        (cfg.rollout.generation_batch_size >= 0, "rollout.generation_batch_size",
         "must be >= 0 (0: all of a step's sequences at once)"),
        (cfg.trainer.weight_decay >= 0, "trainer.weight_decay", "must be >= 0"),
        (0 <= cfg.trainer.adam_beta1 < 1 and 0 <= cfg.trainer.adam_beta2 < 1, "trainer.adam_beta1",
         "and trainer.adam_beta2 must be in [0, 1)"),
        (cfg.trainer.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0"),
        (cfg.trainer.lr_schedule in ("constant", "cosine", "linear"), "trainer.lr_schedule",
         "must be one of constant, cosine, linear"),
        (cfg.trainer.grad_clip >= 0, "trainer.grad_clip", "must be >= 0 (0 turns clipping off)"),
        (cfg.trainer.zero_advantage_rows in ("forward", "skip", "train"), "trainer.zero_advantage_rows",
         "must be forward (no backward pass for sequences with no share in the gradient), skip (no pass at "
         "all) or train (as any other sequence)"),
        (cfg.trainer.eval_every >= 0, "trainer.eval_every", "must be >= 0 (0: no evaluation during training)"),
        (cfg.trainer.eval_max_new_tokens >= 0, "trainer.eval_max_new_tokens",
         "must be >= 0 (0: rollout.max_new_tokens)"),
        (cfg.trainer.num_threads >= 0, "trainer.num_threads", "must be >= 0 (0: torch's default)"),
        (re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", cfg.trainer.device) is not None, "trainer.device",
         "must be auto, cpu, cuda, cuda:N, mps or xpu"),
        (cfg.algorithm.overlong_buffer < cfg.rollout.max_new_tokens, "algorithm.overlong_buffer",
         f"must be less than rollout.max_new_tokens={cfg.rollout.max_new_tokens}: DAPO's soft punishment "
         "starts overlong_buffer tokens before the limit, so a buffer as long as the limit punishes every "
         "response (set about a quarter of max_new_tokens, or 0 to turn it off)"),
        (cfg.trainer.resume != "auto" or bool(cfg.trainer.run_name), "trainer.resume",
         "=auto needs a fixed trainer.run_name (the default name has a timestamp, so a new run "
         "would never find the old checkpoints); set trainer.run_name=NAME"),
    ]
    return checks


# Options of one method that do nothing unless another key turns it on: a value set there is a
# mistake to say, not to ignore (dotted section, its keys, whether the method is on, what turns it on).
# Keys None: every field of the section but ``enabled`` (a nested option section), so the list cannot drift.
_GATED = [
    *[(f"algorithm.{name}", None, (lambda c, name=name: getattr(c.algorithm, name).enabled),
       f"algorithm.{name}.enabled=true") for name in ("guide", "ampo", "scope", "calibrl", "alp", "recap", "scaffold",
                                                                "safe", "rlfr", "agent_rlvr")],
    ("rollout", ("ead_tau_max", "ead_tau_min", "ead_decay", "ead_decay_growth", "ead_decay_max", "ead_warmup_tokens"),
     lambda c: c.rollout.temperature_schedule == "ead", "rollout.temperature_schedule=ead"),
    ("algorithm", ("std_filter_beta", "std_filter_ema_decay", "std_filter_warmup_steps", "std_filter_init_steps"),
     lambda c: c.algorithm.dynamic_sampling_filter == "std", "algorithm.dynamic_sampling_filter=std"),
    ("algorithm", ("ref_reset_optimizer",), lambda c: c.algorithm.ref_reset_every > 0, "algorithm.ref_reset_every > 0"),
    ("rollout", ("search_corpus", "search_top_k"), lambda c: "search" in c.rollout.tools or c.rollout.self_search.sim2real,
     "rollout.tools=[search] (or rollout.self_search.sim2real=true)"),
    ("rollout.self_search", None, lambda c: c.rollout.self_search.enabled, "rollout.self_search.enabled=true"),  # SSRL
    ("algorithm.ssp", None, lambda c: c.algorithm.ssp.enabled, "algorithm.ssp.enabled=true"),  # SSP (trainer/ssp_round.py)
    # ETR / PACS (algorithms/etr.py, algorithms/pacs.py): options of their objective only.
    ("algorithm", ("etr_adv_coef", "etr_var_coef"), lambda c: c.algorithm.loss == "etr",
     "algorithm.loss=etr (algorithm.name=etr)"),
    ("algorithm", ("pacs_beta", "pacs_class_balance"), lambda c: c.algorithm.loss == "pacs",
     "algorithm.loss=pacs (algorithm.name=pacs)"),
    # α-GFN mixing (algorithms/alpha_gfn.py): an option of FlowRL's objective only.
    ("algorithm", ("flowrl_alpha",), lambda c: c.algorithm.loss == "flowrl", "algorithm.loss=flowrl (algorithm.name=flowrl)"),
    # ReasonMaxxer (algorithms/reasonmaxxer.py): its gate and contrast weight, options of its objective only.
    ("algorithm", ("reasonmaxxer_top_frac", "reasonmaxxer_entropy_threshold", "reasonmaxxer_neg_weight"),
     lambda c: c.algorithm.loss == "reasonmaxxer", "algorithm.loss=reasonmaxxer (algorithm.name=reasonmaxxer)"),
    ("algorithm", ("canon_metric", "canon_inter_weight"), lambda c: c.algorithm.advantage == "canon",
     "algorithm.advantage=canon"),
    # ER/ERV/ERA shaping (algorithms/er_shaping.py): its knobs act only with a positive coefficient.
    ("algorithm", ("er_shaping_kappa", "er_shaping_gain", "er_shaping_ema", "er_shaping_stride"),
     lambda c: c.algorithm.er_shaping_coef > 0, "algorithm.er_shaping_coef > 0"),
    # SIREN (algorithms/siren.py): its knobs act only with a positive coefficient, the decay only with an EMA anchor.
    ("algorithm", ("siren_top_p", "siren_peak_frac", "siren_anchor"), lambda c: c.algorithm.siren_coef > 0,
     "algorithm.siren_coef > 0"),
    ("algorithm", ("siren_anchor_decay",), lambda c: c.algorithm.siren_coef > 0 and c.algorithm.siren_anchor == "ema",
     "algorithm.siren_coef > 0 and algorithm.siren_anchor=ema"),
    # EPO's smoothing (algorithms/epo.py): its band and history act only when on, the decay rate only with a schedule.
    ("algorithm", ("epo_low", "epo_high", "epo_mode", "epo_window", "epo_horizon"), lambda c: c.algorithm.epo_coef > 0,
     "algorithm.epo_coef > 0"),
    ("algorithm", ("epo_gamma",), lambda c: c.algorithm.epo_coef > 0 and c.algorithm.epo_horizon > 0,
     "algorithm.epo_coef > 0 and algorithm.epo_horizon > 0"),
    ("algorithm", ("vf_soft_min_alpha",), lambda c: c.algorithm.vf_double_critic, "algorithm.vf_double_critic=true"),
    ("rollout", ("dars_schedule", "dars_max_extra", "dars_threshold"), lambda c: c.rollout.extra_rollouts == "dars",
     "rollout.extra_rollouts=dars"),
    ("rollout", ("cure_originals", "cure_branches", "cure_top_k", "cure_selection", "cure_min_token_chars", "cure_steps"),
     lambda c: c.rollout.extra_rollouts == "cure", "rollout.extra_rollouts=cure"),
    # ARRoL (trainer/arrol_rollouts.py): its pruning and head knobs act only while it is on.
    ("rollout.arrol", None, lambda c: c.rollout.arrol.enabled, "rollout.arrol.enabled=true"),
    # ARPO (rollout/arpo_branching.py): its branching and attribution knobs act only while it is on.
    ("rollout.arpo", None, lambda c: c.rollout.arpo.enabled, "rollout.arpo.enabled=true"),
    ("algorithm.refuel", None, lambda c: c.algorithm.loss == "refuel", "algorithm.name=refuel"),  # REFUEL's η, ...
    # ROSE (rollout/semantic_tree.py, algorithms/rose.py): the tree's knobs act only while it is on, α only with rose.
    ("rollout.semantic_tree", None, lambda c: c.rollout.semantic_tree.enabled, "rollout.semantic_tree.enabled=true"),
    ("algorithm", ("rose_length_alpha",), lambda c: c.algorithm.advantage == "rose", "algorithm.advantage=rose"),
    # DeepSearch (rollout/mcts_search.py, algorithms/deepsearch.py): the search's knobs act only while it is on.
    ("rollout.mcts", None, lambda c: c.rollout.mcts.enabled, "rollout.mcts.enabled=true"),
    # WebAgent-R1 (rollout/context_compression.py): keep_last and the placeholder act only while it is on.
    ("rollout.context_compression", None, lambda c: c.rollout.context_compression.enabled,
     "rollout.context_compression.enabled=true"),
    ("task.inspo", None, lambda c: c.task.inspo.enabled, "task.inspo.enabled=true"),  # INSPO's population knobs
    ("algorithm", ("mssr_rho", "mssr_prior"), lambda c: c.algorithm.advantage == "mssr",
     "algorithm.advantage=mssr (algorithm.name=mssr)"),
    # BRAIn (algorithms/brain.py): the temperature of its posterior, an option of its objective only.
    ("algorithm", ("brain_beta",), lambda c: c.algorithm.loss == "brain", "algorithm.loss=brain (algorithm.name=brain)"),
    # OREAL (algorithms/oreal.py): its weights act only with its objective, the head's learning rate only with the head.
    ("algorithm", ("oreal_neg_weight", "oreal_pos_mult_adv", "oreal_token_rm"), lambda c: c.algorithm.loss == "oreal",
     "algorithm.loss=oreal (algorithm.name=oreal)"),
    ("algorithm", ("oreal_token_rm_lr_multiplier",),
     lambda c: c.algorithm.loss == "oreal" and c.algorithm.oreal_token_rm,
     "algorithm.loss=oreal and algorithm.oreal_token_rm=true"),
    # STEER (algorithms/steer.py): its token weighting's knobs, options of its objective only.
    ("algorithm", ("steer_weight_min", "steer_weight_max", "steer_mapping", "steer_omega_floor"),
     lambda c: c.algorithm.loss == "steer", "algorithm.loss=steer (algorithm.name=steer)"),
    # AEPO (algorithms/aepo.py): its entropy-aware advantage and gradient-preserving clip, options of its objective only.
    ("algorithm", ("aepo_entropy_alpha", "aepo_balanced_clip"), lambda c: c.algorithm.loss == "aepo",
     "algorithm.loss=aepo (algorithm.name=aepo)"),
    # PRM-Clip (algorithms/prm_shaping.py): η acts only in the clipping modes.
    ("reward", ("prm_eta",), lambda c: c.reward.prm_shaping in ("clip", "clip_delta"),
     "reward.prm_shaping=clip or clip_delta"),
    # SPAE (algorithms/spae.py): its probe and penalty knobs act only with a positive coefficient.
    ("algorithm", ("spae_delimiter", "spae_probe", "spae_saturation", "spae_saturation_penalty", "spae_max_steps"),
     lambda c: c.algorithm.spae_coef > 0, "algorithm.spae_coef > 0"),
    # RLTF-SD (algorithms/rltf_sd.py): its weighting acts only with a positive coefficient.
    ("algorithm", ("rltf_sd_weighting",), lambda c: c.algorithm.rltf_sd_coef > 0, "algorithm.rltf_sd_coef > 0"),
    # SPEAR (trainer/spear_replay.py): its replay knobs act only while it is on.
    ("algorithm.spear", None, lambda c: c.algorithm.spear.enabled, "algorithm.spear.enabled=true"),
    ("algorithm.svs", None, lambda c: c.algorithm.svs.enabled, "algorithm.svs.enabled=true"),  # SvS (trainer/svs_step.py)
    # RoRecomp (trainer/rorecomp.py): its buffer knobs act only while it is on.
    ("algorithm", ("rorecomp_compensation_rows", "rorecomp_buffer_size", "rorecomp_max_age"),
     lambda c: c.algorithm.rorecomp_fraction > 0, "algorithm.rorecomp_fraction > 0"),
    ("rollout", ("max_env_turns",), lambda c: bool(c.rollout.environment), "rollout.environment=NAME"),
    ("rollout", ("async_tools",), lambda c: bool(c.rollout.tools), "rollout.tools=[NAME, ...]"),  # rollout/async_turns.py
    ("algorithm", ("gigpo_step_weight", "gigpo_gamma", "gigpo_norm"), lambda c: c.algorithm.advantage == "gigpo",
     "algorithm.advantage=gigpo"),
    ("algorithm.hiper", None, lambda c: c.algorithm.advantage == "hiper", "algorithm.advantage=hiper"),  # HiPER's HAE
    ("algorithm.archer", None, lambda c: c.algorithm.advantage == "archer", "algorithm.advantage=archer"),  # ArCHer
    ("algorithm.hiper", ("segment_turns",), lambda c: c.algorithm.hiper.segments != "tags",
     "algorithm.hiper.segments=fixed"),
    ("algorithm.tcod", None, lambda c: c.algorithm.tcod.enabled, "algorithm.tcod.enabled=true"),  # TCOD's curriculum
    # Turn-level credit (algorithms/turn_credit.py): each key acts only with the estimators that read it.
    ("algorithm", ("turn_credit_norm",), lambda c: c.algorithm.advantage in ("turn_broadcast", "turn_norm", "spa"),
     "algorithm.advantage=turn_broadcast, turn_norm or spa"),
    ("algorithm", ("turn_credit_gamma",), lambda c: c.algorithm.advantage in ("turn_norm", "spa"),
     "algorithm.advantage=turn_norm or spa"),
    ("algorithm", ("turn_credit_turn_mean",), lambda c: c.algorithm.advantage == "turn_broadcast",
     "algorithm.advantage=turn_broadcast"),
    ("algorithm", ("spa_progress_coef", "spa_grounding_coef", "spa_lr", "spa_fit_steps"),
     lambda c: c.algorithm.advantage == "spa", "algorithm.advantage=spa"),
    # Low-likelihood curation (trainer/curation.py): its pre-pass knobs act only when it is on.
    ("task", ("curation_min_rate", "curation_max_rate", "curation_samples", "curation_prompts"),
     lambda c: c.task.curation != "none", "task.curation=low_likelihood"),
    ("task.sws", None, lambda c: c.task.sws.enabled, "task.sws.enabled=true"),  # SwS (trainer/sws_synthesis.py)
    ("task.eva", None, lambda c: c.task.eva.enabled, "task.eva.enabled=true"),  # eva (trainer/eva_evolve.py)
    ("task.cobalt", None, lambda c: c.task.cobalt.enabled, "task.cobalt.enabled=true"),  # Cobalt (data/cobalt_contexts.py)
    ("trainer.async_rollouts", None, lambda c: c.trainer.async_rollouts.enabled,  # trainer/async_rollouts.py
     "trainer.async_rollouts.enabled=true"),
]


def _refuse_inactive(cfg: Config, only: str = "") -> None:
    """ConfigError for the first ``_GATED`` option set while its method is off; ``only``: just the entries whose
    section starts with it."""
    for section, keys, active, turn_on in _GATED:
        if not section.startswith(only) or active(cfg):
            continue
        if (error := section_knob_error(get_key(cfg, section), section, turn_on, keys)) is not None:
            raise ConfigError(error)


def refuse_inactive_algorithm_keys(algorithm) -> None:
    """``_GATED``'s algorithm entries for an AlgorithmConfig on its own: resolve.check_algorithm runs them, so that
    ``resolve_algorithm`` called directly (the public API, benchmarks/) refuses what load_config refuses. Those
    entries read only ``c.algorithm``; a stand-in with nothing else makes one that reads more fail loudly."""
    _refuse_inactive(SimpleNamespace(algorithm=algorithm), only="algorithm")


def section_knob_error(obj, prefix: str, turn_on: str, keys=None) -> str | None:
    """The refusal of the first of ``keys`` of ``obj`` (a config section named ``prefix``) that differs from
    its default, or None; the caller knows the method that reads them is off. ``keys`` None: every field of
    the section but ``enabled``."""
    default = type(obj)()
    if keys is None:
        keys = [f.name for f in dataclasses.fields(obj) if f.name != "enabled"]
    for key in keys:
        if getattr(obj, key) != getattr(default, key):
            return inactive_key_error(f"{prefix}.{key}", getattr(obj, key), turn_on)
    return None


def inactive_key_error(key: str, value, turn_on: str) -> str:
    """The refusal of an option set while its method is off (``turn_on``: what turns the method on)."""
    return f"config key '{key}' has no effect unless {turn_on} (got {value!r}); set {turn_on} or leave it at its default"


def get_key(cfg: Config, key: str):
    """The value of the dotted config key ``key`` (``rollout.arpo.beta``), for a refusal's "(got ...)"."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _reward_named(cfg: Config, name: str) -> bool:
    return any(getattr(f, "name", None) == name for f in cfg.reward.functions)


def _changed(section) -> bool:
    """A nested option section differing from its defaults (its method on, or one of its knobs set)."""
    return section != type(section)()


class MethodCheck(NamedTuple):
    on: Callable[[Config], bool]  # whether the check applies (False on the default config: nothing imported)
    target: str  # "module:function", imported only when ``on``; it raises ConfigError or returns the refusal's text
    why: str  # what it refuses, for the reader
    arg: Callable[[Config], Any] = lambda cfg: cfg  # what the function takes (the whole config unless said)


# Each method's whole-config check. The algorithm section's own checks (ranges, keys refused with the wrong
# loss, STEER's keys, ...) run in resolve.check_algorithm before these; a check listed here reads other sections.
_METHOD_CHECKS = (
    MethodCheck(lambda c: c.algorithm.advantage == "weighted_grpo" and not c.task.pairing,
                "anabranch.algorithms.weighted_grpo:check_needs_pairing", "Weighted GRPO reads pairing's q+/q− roles"),
    MethodCheck(lambda c: c.task.curation != "none", "anabranch.trainer.curation:check_curation_config",
                "low-likelihood curation vs DPH's exclude_from_rl, pairing, ..."),
    MethodCheck(lambda c: c.task.cobalt.enabled, "anabranch.data.cobalt_contexts:check_config",
                "Cobalt: key ranges, a verifier, no tools / environment / retry turns / mixture / DDP"),
    MethodCheck(lambda c: c.task.name == "random_calculation", "anabranch.data.random_calculation:check_params",
                "its task.params, refused at load rather than at the first data load", lambda c: c.task.params),
    MethodCheck(lambda c: c.task.name == "number_guess", "anabranch.rollout.env_games:check_params",
                "its task.params, refused at load rather than at the first data load", lambda c: c.task.params),
    MethodCheck(lambda c: c.algorithm.loss == "pacs", "anabranch.algorithms.pacs:check_pacs_rewards",
                "PACS's label is the reward in [0, 1]"),
    MethodCheck(lambda c: c.algorithm.loss == "flowrl" and c.algorithm.flowrl_alpha != 0.5,
                "anabranch.algorithms.alpha_gfn:check_alpha_config", "α-GFN's α: in (0, 1), with flowrl.length_norm=false",
                lambda c: c.algorithm),
    MethodCheck(lambda c: c.rollout.retry_turns >= 2 or _reward_named(c, "retry_turns"),
                "anabranch.rollout.retry_turns:check_config",
                "UFO's retry turns: tools, Guide, SRPO, CURE, the correctness reward; its reward without retry turns"),
    MethodCheck(lambda c: c.algorithm.advantage == "trloo", "anabranch.algorithms.trloo:check_trloo_config",
                "TRLOO's per-attempt rewards: retry turns, no ignored reward terms"),
    MethodCheck(lambda c: bool(c.rollout.environment) or _reward_named(c, "env_return") or _reward_named(c, "env_solved"),
                "anabranch.rollout.environments:check_config", "environments: other multi-turn modes, its rewards"),
    MethodCheck(lambda c: c.algorithm.advantage == "gigpo", "anabranch.algorithms.gigpo:check_gigpo_config",
                "GiGPO: ranges, rollout.environment, losses that ignore advantages, UCAS/ProGRPO"),
    MethodCheck(lambda c: c.algorithm.advantage == "hiper", "anabranch.algorithms.hiper:check_hiper_config",
                "HiPER: ranges, rollout.environment, losses that ignore advantages, UCAS/ProGRPO"),
    MethodCheck(lambda c: c.algorithm.advantage == "archer", "anabranch.algorithms.archer:check_archer_config",
                "ArCHer: ranges, rollout.environment, losses that ignore advantages, UCAS/ProGRPO"),
    MethodCheck(lambda c: c.algorithm.tcod.enabled, "anabranch.algorithms.tcod:check_tcod_run",
                "TCOD: a multi-turn rollout (environment or tools), depths within the episodes' turn cap"),
    MethodCheck(lambda c: c.algorithm.advantage in ("turn_broadcast", "turn_norm", "spa"),
                "anabranch.algorithms.turn_credit:check_turn_credit_config",
                "turn credit: ranges, rollout.environment, losses that ignore advantages, Flow-GRPO's aggregation"),
    MethodCheck(lambda c: c.algorithm.spae_coef > 0, "anabranch.trainer.spae_step:check_spae_run",
                "SPAE with tools / retry turns"),
    MethodCheck(lambda c: c.algorithm.srpo_coef > 0, "anabranch.trainer.srpo_step:check_srpo_run", "SRPO with tools"),
    MethodCheck(lambda c: c.algorithm.rltf_sd_coef > 0, "anabranch.algorithms.rltf_sd:check_rltf_sd_config",
                "RLTF-SD distils the retries of multi-attempt episodes: retry turns"),
    MethodCheck(lambda c: c.algorithm.prof_keep != 0, "anabranch.algorithms.prof:check_config",
                "PROF: 2 <= m < n, its `prm` source, no rebuilt groups"),
    MethodCheck(lambda c: c.reward.prm_shaping != "none" or _reward_named(c, "prm"),
                "anabranch.algorithms.prm_shaping:check_config",
                "PRM-Clip/Delta: its `prm` source, a token-level estimator, no rebuilt rollouts"),
    MethodCheck(lambda c: _reward_named(c, "gen_prm"), "anabranch.algorithms.capo:check_config",
                "CAPO: one critic folder, a token-level estimator at γ=1, no PRM shaping, no rebuilt rollouts"),
    MethodCheck(lambda c: _reward_named(c, "rlsp_exploration"), "anabranch.rewards.exploration:check_config",
                "RLSP's exploration reward: its options, its weight below the verifier's"),
    MethodCheck(lambda c: _reward_named(c, "domain_router"), "anabranch.rewards.domain_router:check_config",
                "Guru's domain router: its routes' names and options, judge routes only with thread isolation"),
    MethodCheck(lambda c: c.rollout.extra_rollouts == "dars", "anabranch.trainer.extra_rollouts:check_config",
                "DARS: prompt pairing, group-level rewards"),
    MethodCheck(lambda c: c.rollout.extra_rollouts == "cure", "anabranch.trainer.cure_rollouts:check_config",
                "CURE's key ranges, rollout.n, backend and tools"),
    MethodCheck(lambda c: c.rollout.context_compression.enabled, "anabranch.trainer.turn_rows:check_config",
                "WebAgent-R1: an environment, M-GRPO's estimator / loss / aggregation, no one-row-per-trajectory ones"),
    MethodCheck(lambda c: c.rollout.arrol.enabled, "anabranch.trainer.arrol_rollouts:check_config",
                "ARRoL: key ranges, hf backend, single-turn rollouts, losses over whole responses, own-row methods"),
    MethodCheck(lambda c: c.algorithm.loss == "refuel", "anabranch.trainer.refuel_rollouts:check_config",
                "REFUEL: η, even rollout.n, the round builders' shared refusals, methods that break its pairs"),
    MethodCheck(lambda c: c.rollout.arpo.enabled, "anabranch.rollout.arpo_branching:check_config",
                "ARPO: key ranges, tools, no retry turns / environments / CURE / DARS / ARRoL, advantage-reading losses"),
    MethodCheck(lambda c: c.rollout.async_tools, "anabranch.rollout.async_turns:check_config",
                "asynchronous tool rollouts: ARPO's branching"),
    MethodCheck(lambda c: c.rollout.mcts.enabled, "anabranch.rollout.mcts_search:check_config",
                "DeepSearch's MCTS: key ranges, advantage=deepsearch, hf backend, single turn, other round builders"),
    MethodCheck(lambda c: c.algorithm.advantage == "deepsearch", "anabranch.algorithms.deepsearch:check_deepsearch_config",
                "DeepSearch's advantage: rollout.mcts, advantage-reading losses"),
    MethodCheck(lambda c: c.rollout.semantic_tree.enabled, "anabranch.rollout.semantic_tree:check_config",
                "ROSE's trees: key ranges, hf backend, single-turn rollouts, other branchers, losses over whole responses"),
    MethodCheck(lambda c: c.algorithm.advantage == "rose", "anabranch.algorithms.rose:check_rose_config",
                "ROSE's advantage: α, tree rollouts, losses that ignore advantages, UCAS/ProGRPO"),
    MethodCheck(lambda c: c.algorithm.rorecomp_fraction != 0, "anabranch.trainer.rorecomp:check_config",
                "RoRecomp: key ranges, rollout.n, refused methods"),
    MethodCheck(lambda c: c.algorithm.spear.enabled, "anabranch.trainer.spear_replay:check_config",
                "SPEAR: ranges, RoRecomp, losses ignoring Â or reading groups, row rebuilders, tool_reward w/o tools"),
    MethodCheck(lambda c: c.algorithm.guide.enabled, "anabranch.algorithms.guide:check_run",
                "Guide: backend, tools and pairing it cannot take"),
    MethodCheck(lambda c: c.algorithm.scaffold.enabled, "anabranch.algorithms.scaffold:check_run",
                "GHPO scaffolding: the same refusals as Guide's"),
    MethodCheck(lambda c: _changed(c.algorithm.agent_rlvr), "anabranch.algorithms.agent_rlvr:check_agent_rlvr",
                "Agent-RLVR: key ranges, Guide/scaffolding/HPT/dynamic sampling/retry turns, Guide's refusals"),
    MethodCheck(lambda c: c.algorithm.ampo.enabled, "anabranch.algorithms.ampo:check_run",
                "AMPO: backend, tools, retry turns and pairing it cannot take"),
    MethodCheck(lambda c: c.algorithm.svs.enabled, "anabranch.algorithms.svs:check_run",
                "SvS: tools, retry turns, environments, pairing, mixtures, process rewards, row rewriters"),
    MethodCheck(lambda c: c.rollout.self_search.enabled, "anabranch.rollout.self_search:check_config",
                "SSRL: no tools / environments / retry turns / other round builders, masking vs whole-response losses"),
    MethodCheck(lambda c: "search" in c.rollout.tools, "anabranch.rollout.search_tool:check_config",
                "the search tool: search_top_k >= 1, a readable search_corpus"),
    MethodCheck(lambda c: c.algorithm.ssp.enabled, "anabranch.algorithms.ssp:check_run",
                "SSP: the search tool, answers, proposals >= 2, retry turns, environments, row rewriters"),
    MethodCheck(lambda c: c.task.sws.enabled, "anabranch.algorithms.sws:check_run",
                "SwS: key ranges, one process, tools, retry turns, environments, a verifier, fixed samplers, rewriters"),
    MethodCheck(lambda c: c.task.eva.enabled, "anabranch.algorithms.eva:check_run",
                "eva: key ranges, one process, tools, retry turns, environments, row fields, fixed samplers, SwS/SvS"),
    MethodCheck(lambda c: c.algorithm.scope.enabled, "anabranch.algorithms.scope:check_run",
                "SCOPE: backend, tools, PRM shaping it cannot take; its model folders"),
    MethodCheck(lambda c: _changed(c.algorithm.calibrl), "anabranch.algorithms.calibrl:check_run",
                "CalibRL: rollout.n, tools, retry turns, temperature schedule"),
    MethodCheck(lambda c: _changed(c.algorithm.alp), "anabranch.algorithms.alp:check_run",
                "ALP: trainer.compile_layers"),
    MethodCheck(lambda c: _changed(c.algorithm.recap), "anabranch.algorithms.recap:check_run",
                "RECAP: keys, filters that would bias its RL tracked loss"),
    MethodCheck(lambda c: c.algorithm.ref_reset_every > 0, "anabranch.trainer.ref_reset:check_ref_reset",
                "ProRL's reference reset with LoRA"),
    MethodCheck(lambda c: _changed(c.algorithm.rlfr), "anabranch.trainer.latent_flow_step:check_run",
                "RLFR: key ranges, a loss that trains on Â, a source to fit the flow on"),
    MethodCheck(lambda c: c.trainer.async_rollouts.enabled, "anabranch.trainer.async_rollouts:check_config",
                "async rollouts: key ranges, ppo_clip, one process, samplers reading this step, own rollout rounds"),
    MethodCheck(lambda c: c.task.inspo.enabled, "anabranch.trainer.instruction_population:check_config",
                "INSPO: key ranges, a seed instruction, methods that rebuild or key on the prompts"),
)


def _std_on_accuracy(cfg: Config) -> str:
    # RLPR's filter measures the spread of the reward; on the right/wrong flags it measures p̂(1−p̂).
    return ("algorithm.dynamic_sampling_filter=std with algorithm.dynamic_sampling_metric=accuracy: the std is taken "
            "over the correctness reward's right/wrong flags, not over the reward the policy is trained on (RLPR "
            "filters on its probability reward: set algorithm.dynamic_sampling_metric=reward)")


def _ead_warning(cfg: Config) -> str | None:
    from anabranch.rollout.temperature_schedule import ead_tis_warning  # imported only then: it needs torch

    return ead_tis_warning(cfg)


# Settings that can work but probably are not what was meant: (applies, the warning's text or None).
_WARNINGS = (
    (lambda c: c.algorithm.dynamic_sampling_filter == "std" and c.algorithm.dynamic_sampling_metric == "accuracy",
     _std_on_accuracy),
    (lambda c: c.rollout.temperature_schedule == "ead", _ead_warning),
)
_WARNED_ATTR = "_config_checks_warned"  # the texts already warned about for one Config object (_first_time)
