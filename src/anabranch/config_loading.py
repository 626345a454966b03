"""Building a :class:`~anabranch.config.Config`: YAML files, dotted ``key=value`` overrides, type
checks with "did you mean" suggestions, and range validation."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from anabranch.config import Config, ConfigError, RewardFunctionConfig

# --------------------------------------------------------------------------- building


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``key=value`` overrides, validated."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    cfg = from_dict(Config, data, prefix="")
    # Resolve the recipe now, knowing which algorithm keys the user set, so that an explicit value
    # wins even when it equals the default and config.yaml records what actually runs.
    from anabranch.algorithms.resolve import apply_recipe

    cfg.algorithm = apply_recipe(cfg.algorithm, explicit=set(data.get("algorithm") or {}))
    validate(cfg)
    return cfg


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (for example rollout.n=8)")
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("-")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every settable dotted key (leaves only)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], prefix + f.name + "."))
        else:
            keys.append(prefix + f.name)
    return keys


def closest_key(key: str) -> str | None:
    valid = all_keys(Config)
    section, _, leaf = key.rpartition(".")
    same_section = [k for k in valid if k.rpartition(".")[0] == section]
    leaves = {k.rpartition(".")[2]: k for k in same_section}
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
    if close:
        return leaves[close[0]]
    # A leaf in another section ("lr" -> "trainer.lr"), else anything alike.
    exact = [k for k in valid if k.rpartition(".")[2] == leaf]
    if exact:
        return exact[0]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return close[0] if close else None


def _unknown_key(key: str) -> ConfigError:
    close = closest_key(key)
    hint = f" Did you mean {close!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint}")


def from_dict(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key(prefix + str(key))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = coerce(hints[f.name], data[f.name], prefix + f.name)
    return cls(**kwargs)


def coerce(tp, value: Any, key: str):
    """Check ``value`` against the annotation ``tp``; convert where it is lossless."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], value, key)
    if key == "reward.functions":
        return [coerce_reward_function(v, f"{key}[{i}]") for i, v in enumerate(_as_list(value, key))]
    if tp is list or origin is list:
        return _as_list(value, key)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} expects a mapping, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key {key!r} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-5" as a string
            except ValueError:
                pass
        raise ConfigError(f"config key {key!r} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key {key!r} expects a string, got {value!r}")
    return value


def _as_list(value: Any, key: str) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    raise ConfigError(f"config key {key!r} expects a list, got {value!r}")


def coerce_reward_function(value: Any, key: str) -> RewardFunctionConfig:
    """``reward.functions`` items: a name, ``name:weight`` or a mapping."""
    if isinstance(value, RewardFunctionConfig):
        return value
    if isinstance(value, str):
        name, weight = value, 1.0
        # "math_verify*0.5" sets a weight; "pkg.mod:fn" stays a user function spec.
        if "*" in value:
            name, _, w = value.rpartition("*")
            weight = coerce(float, w, key + ".weight")
        return RewardFunctionConfig(name=name, weight=weight)
    return from_dict(RewardFunctionConfig, value, key + ".")


# --------------------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Range checks that need no imports of heavy modules."""
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
    for ok, key, why in checks:
        if not ok:
            raise ConfigError(f"config key {key!r} {why} (got {_get(cfg, key)!r})")
    _refuse_inactive(cfg)
    # Weighted GRPO reads the q+/q− roles of prompt pairing: refused here, before any model loads.
    if cfg.algorithm.advantage == "weighted_grpo" and not cfg.task.pairing:
        from anabranch.algorithms.weighted_grpo import check_needs_pairing

        check_needs_pairing(cfg)
    if cfg.task.curation != "none":  # low-likelihood curation vs DPH's exclude_from_rl: refused before any model loads
        from anabranch.trainer.curation import check_curation_config

        check_curation_config(cfg)
    if cfg.task.name == "random_calculation":  # its task.params, refused at load rather than at the first data load
        from anabranch.data.random_calculation import check_params

        check_params(cfg.task.params)
    if cfg.algorithm.loss == "pacs":  # the reward is PACS's label in [0, 1]: refused before any model loads
        from anabranch.algorithms.pacs import check_pacs_rewards

        check_pacs_rewards(cfg)
    if cfg.rollout.retry_turns >= 2 or any(getattr(f, "name", None) == "retry_turns" for f in cfg.reward.functions):
        # UFO's retry turns: tools, Guide, SRPO, the correctness reward; its reward without retry turns
        from anabranch.rollout.retry_turns import check_config as check_retry_turns

        check_retry_turns(cfg)
    if cfg.algorithm.advantage == "trloo":  # TRLOO's per-attempt rewards: retry turns, no ignored reward terms
        from anabranch.algorithms.trloo import check_trloo_config

        check_trloo_config(cfg)
    if cfg.algorithm.spae_coef > 0:  # SPAE with tools / retry turns (trainer/spae_step.py; loop.py keeps a backstop)
        from anabranch.trainer.spae_step import check_spae_run

        check_spae_run(cfg)
    if cfg.algorithm.rltf_sd_coef > 0:  # RLTF-SD distils the retries of multi-attempt episodes: retry turns
        from anabranch.algorithms.rltf_sd import check_rltf_sd_config

        check_rltf_sd_config(cfg)
    if cfg.algorithm.prof_keep != 0:  # PROF (algorithms/prof.py): 2 <= m < n, its `prm` source, no rebuilt groups
        from anabranch.algorithms.prof import check_config as check_prof

        check_prof(cfg)
    if cfg.reward.prm_shaping != "none" or any(getattr(f, "name", None) == "prm" for f in cfg.reward.functions):
        # PRM-Clip/Delta (algorithms/prm_shaping.py): its `prm` source, a token-level estimator, no rebuilt rollouts
        from anabranch.algorithms.prm_shaping import check_config as check_prm_shaping

        check_prm_shaping(cfg)
    if any(getattr(f, "name", None) == "rlsp_exploration" for f in cfg.reward.functions):
        # RLSP's exploration reward (rewards/exploration.py): its options, its weight below the verifier's
        from anabranch.rewards.exploration import check_config as check_exploration

        check_exploration(cfg)
    if cfg.rollout.extra_rollouts == "dars":  # refused combinations (prompt pairing, group-level rewards)
        from anabranch.trainer.extra_rollouts import check_config as check_extra_rollouts

        check_extra_rollouts(cfg)
    if cfg.rollout.extra_rollouts == "cure":  # CURE's key ranges, rollout.n, backend and tools (trainer/cure_rollouts.py)
        from anabranch.trainer.cure_rollouts import check_config as check_cure

        check_cure(cfg)
    if cfg.algorithm.rorecomp_fraction != 0:  # RoRecomp (trainer/rorecomp.py): key ranges, rollout.n, refused methods
        from anabranch.trainer.rorecomp import check_config as check_rorecomp

        check_rorecomp(cfg)
    if cfg.algorithm.loss == "steer":  # STEER (algorithms/steer.py): its keys' ranges, the other mapping's knob
        from anabranch.algorithms.steer import raise_if_bad as check_steer

        check_steer(cfg.algorithm)
    if cfg.algorithm.guide.enabled:  # Guide (algorithms/guide.py): backend, tools and pairing it cannot take
        from anabranch.algorithms.guide import check_run as check_guide_run

        check_guide_run(cfg)
    if cfg.algorithm.scaffold.enabled:  # GHPO scaffolding (algorithms/scaffold.py): the same refusals as Guide's
        from anabranch.algorithms.scaffold import check_run as check_scaffold_run

        check_scaffold_run(cfg)
    if cfg.algorithm.ampo.enabled:  # AMPO (algorithms/ampo.py): backend, tools, retry turns and pairing it cannot take
        from anabranch.algorithms.ampo import check_run as check_ampo_run

        check_ampo_run(cfg)
    if cfg.algorithm.scope.enabled:  # SCOPE (algorithms/scope.py): backend, tools, PRM shaping it cannot take; folders
        from anabranch.algorithms.scope import check_run as check_scope_run

        check_scope_run(cfg)
    if cfg.algorithm.calibrl != type(cfg.algorithm.calibrl)():  # CalibRL (algorithms/calibrl.py): keys, knobs set
        from anabranch.algorithms.calibrl import check_run as check_calibrl_run  # while off, rollout.n, tools

        check_calibrl_run(cfg)
    if cfg.algorithm.alp != type(cfg.algorithm.alp)():  # ALP (algorithms/alp.py): keys, loss, knobs set while off
        from anabranch.algorithms.alp import check_run as check_alp_run

        check_alp_run(cfg)
    if cfg.algorithm.recap != type(cfg.algorithm.recap)():  # RECAP (algorithms/recap.py): keys, knobs set while off
        from anabranch.algorithms.recap import check_run as check_recap_run

        check_recap_run(cfg)
    if cfg.algorithm.dynamic_sampling_filter == "std" and cfg.algorithm.dynamic_sampling_metric == "accuracy":
        # RLPR's filter measures the spread of the reward; on the right/wrong flags it measures p̂(1−p̂).
        from anabranch.rewards.guard import warn

        warn("algorithm.dynamic_sampling_filter=std with algorithm.dynamic_sampling_metric=accuracy: the std is taken "
             "over the correctness reward's right/wrong flags, not over the reward the policy is trained on (RLPR "
             "filters on its probability reward: set algorithm.dynamic_sampling_metric=reward)")
    if cfg.rollout.temperature_schedule == "ead":  # imported only then: it needs torch
        from anabranch.rewards.guard import warn
        from anabranch.rollout.temperature_schedule import ead_tis_warning

        if (text := ead_tis_warning(cfg)) is not None:
            warn(text)


# Options of one method that do nothing unless another key turns it on: a value set there is a
# mistake to say, not to ignore (section, its keys, whether the method is on, what turns it on).
_GATED = [
    ("rollout", ("ead_tau_max", "ead_tau_min", "ead_decay", "ead_decay_growth", "ead_decay_max", "ead_warmup_tokens"),
     lambda c: c.rollout.temperature_schedule == "ead", "rollout.temperature_schedule=ead"),
    ("algorithm", ("std_filter_beta", "std_filter_ema_decay", "std_filter_warmup_steps", "std_filter_init_steps"),
     lambda c: c.algorithm.dynamic_sampling_filter == "std", "algorithm.dynamic_sampling_filter=std"),
    ("algorithm", ("ref_reset_optimizer",), lambda c: c.algorithm.ref_reset_every > 0, "algorithm.ref_reset_every > 0"),
    # ETR / PACS (algorithms/etr.py, algorithms/pacs.py): options of their objective only.
    ("algorithm", ("etr_adv_coef", "etr_var_coef"), lambda c: c.algorithm.loss == "etr",
     "algorithm.loss=etr (algorithm.name=etr)"),
    ("algorithm", ("pacs_beta", "pacs_class_balance"), lambda c: c.algorithm.loss == "pacs",
     "algorithm.loss=pacs (algorithm.name=pacs)"),
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
    ("rollout", ("dars_schedule", "dars_max_extra", "dars_threshold"), lambda c: c.rollout.extra_rollouts == "dars",
     "rollout.extra_rollouts=dars"),
    ("rollout", ("cure_originals", "cure_branches", "cure_top_k", "cure_selection", "cure_min_token_chars", "cure_steps"),
     lambda c: c.rollout.extra_rollouts == "cure", "rollout.extra_rollouts=cure"),
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
    # PRM-Clip (algorithms/prm_shaping.py): η acts only in the clipping modes.
    ("reward", ("prm_eta",), lambda c: c.reward.prm_shaping in ("clip", "clip_delta"),
     "reward.prm_shaping=clip or clip_delta"),
    # SPAE (algorithms/spae.py): its probe and penalty knobs act only with a positive coefficient.
    ("algorithm", ("spae_delimiter", "spae_probe", "spae_saturation", "spae_saturation_penalty", "spae_max_steps"),
     lambda c: c.algorithm.spae_coef > 0, "algorithm.spae_coef > 0"),
    # RLTF-SD (algorithms/rltf_sd.py): its weighting acts only with a positive coefficient.
    ("algorithm", ("rltf_sd_weighting",), lambda c: c.algorithm.rltf_sd_coef > 0, "algorithm.rltf_sd_coef > 0"),
    # RoRecomp (trainer/rorecomp.py): its buffer knobs act only while it is on.
    ("algorithm", ("rorecomp_compensation_rows", "rorecomp_buffer_size", "rorecomp_max_age"),
     lambda c: c.algorithm.rorecomp_fraction > 0, "algorithm.rorecomp_fraction > 0"),
    # Low-likelihood curation (trainer/curation.py): its pre-pass knobs act only when it is on.
    ("task", ("curation_min_rate", "curation_max_rate", "curation_samples", "curation_prompts"),
     lambda c: c.task.curation != "none", "task.curation=low_likelihood"),
]


def _refuse_inactive(cfg: Config) -> None:
    guide, guide_default = cfg.algorithm.guide, type(cfg.algorithm.guide)()
    if not guide.enabled:  # Guide's knobs (a nested section _GATED cannot name) do nothing while it is off
        for key in ("hint_template", "num_samples"):
            if getattr(guide, key) != getattr(guide_default, key):
                raise ConfigError(f"config key 'algorithm.guide.{key}' has no effect unless algorithm.guide.enabled=true "
                                  f"(got {getattr(guide, key)!r}); set algorithm.guide.enabled=true or leave it at its "
                                  "default")
    if cfg.algorithm.ampo != type(cfg.algorithm.ampo)():  # AMPO's nested section, as Guide's (imported only then)
        from anabranch.algorithms.ampo import inactive_knob

        if (error := inactive_knob(cfg.algorithm.ampo)) is not None:
            raise ConfigError(error)
    if cfg.algorithm.scope != type(cfg.algorithm.scope)():  # SCOPE's nested section, as AMPO's
        from anabranch.algorithms.scope import inactive_knob as scope_inactive_knob

        if (error := scope_inactive_knob(cfg.algorithm.scope)) is not None:
            raise ConfigError(error)
    for section, keys, active, turn_on in _GATED:
        if active(cfg):
            continue
        ours, default = getattr(cfg, section), type(getattr(cfg, section))()
        changed = [k for k in keys if getattr(ours, k) != getattr(default, k)]
        if changed:
            raise ConfigError(inactive_key_error(f"{section}.{changed[0]}", getattr(ours, changed[0]), turn_on))


def inactive_key_error(key: str, value, turn_on: str) -> str:
    """The refusal of an option set while its method is off; shared with the checks that repeat a _GATED
    entry for configs built in code (algorithms/brain.py, algorithms/reasonmaxxer.py)."""
    return f"config key '{key}' has no effect unless {turn_on} (got {value!r}); set {turn_on} or leave it at its default"


def _get(cfg: Config, key: str):
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
