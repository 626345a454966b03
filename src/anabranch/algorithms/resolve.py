"""From ``AlgorithmConfig`` to the functions the trainer calls."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable

from anabranch.algorithms.aggregation import MODES
from anabranch.algorithms.alp import alp_modules, alp_needs, check_alp
from anabranch.algorithms.er_shaping import build_er_shaping, check_er_shaping
from anabranch.algorithms.kdrl import kdrl_on
from anabranch.algorithms.kl import ESTIMATORS
from anabranch.algorithms.registries import (ADVANTAGE_OPTION_REASONS, ADVANTAGE_OPTIONS, ADVANTAGES, OBJECTIVES,
                                             RECIPES)
from anabranch.algorithms.siren import build_siren, check_siren
from anabranch.algorithms.epo import build_epo, check_epo
from anabranch.algorithms.safe import build_safe, check_safe
from anabranch.algorithms.trloo import trloo_inputs
from anabranch.algorithms.gigpo import gigpo_inputs
from anabranch.algorithms.hiper import hiper_inputs
from anabranch.algorithms.turn_credit import turn_credit_inputs
from anabranch.algorithms.deepsearch import deepsearch_inputs
from anabranch.algorithms.rose import rose_inputs
from anabranch.config import AlgorithmConfig, ConfigError


@dataclass
class Algorithm:
    cfg: AlgorithmConfig
    advantage: Callable
    objective: Callable
    needs: frozenset = field(default_factory=frozenset)
    # name -> factory(model_config, algorithm_cfg) -> nn.Module: extra trainable heads the
    # objective reads from ctx.modules (a log Z head, a value head). Registered with the
    # objective as ``modules={...}``; trained with the policy, saved in checkpoints, never exported.
    module_factories: dict = field(default_factory=dict)
    # fn(ctx, response_mask) -> (loss, metrics) added to the objective's loss (the critic loss of
    # gae); registered with the estimator or objective as ``aux_loss=...``.
    aux_losses: tuple = ()
    # The objective's loss is a per-token product with the advantage, so a sequence with Â = 0
    # everywhere adds nothing to the gradient (registered as ``inert_at_zero_advantage=True``;
    # trainer/inert_rows.py).
    inert_at_zero_advantage: bool = False
    # name -> fn(rollout) -> tensor[B]: per-sample inputs of the estimator that the rollout does not
    # hold, set by a trainer part that knows them (prompt pairing's q+/q− ``group_role``,
    # trainer/prompt_pairing.py); passed to the estimator as keyword arguments.
    advantage_inputs: dict = field(default_factory=dict)
    # ER/ERV/ERA shaping's EMA baselines (algorithms/er_shaping.py): None unless algorithm.er_shaping_coef > 0;
    # read by trainer/step.py where the advantages are shaped, saved in checkpoints by trainer/loop.py.
    er_shaping: object = None
    # SIREN's anchor (algorithms/siren.py): None unless algorithm.siren_coef > 0; read by trainer/step.py,
    # saved in checkpoints by trainer/loop.py.
    siren: object = None
    # EPO's entropy history (algorithms/epo.py): None unless algorithm.epo_coef > 0; read by trainer/step.py,
    # saved in checkpoints by trainer/loop.py.
    epo: object = None
    # SAFE's controller (algorithms/safe.py): None unless algorithm.safe.enabled; read by trainer/step.py,
    # saved in checkpoints by trainer/loop.py.
    safe: object = None
    # RLFR's flow net and layer hook (trainer/latent_flow_step.py): None unless algorithm.rlfr.enabled; set by
    # LatentFlow.create (it needs the model), read by trainer/step.py, saved in checkpoints by trainer/loop.py.
    latent_flow: object = None
    # The objective's ``precompute`` hook (registries.py): batch-wide per-row inputs, computed once per update
    # by trainer/step.py; None for every objective but those that register one (ReasonMaxxer).
    precompute: Callable | None = None


def apply_recipe(cfg: AlgorithmConfig, explicit: set | None = None) -> AlgorithmConfig:
    """Fill the fields the user did not set from the named recipe.

    ``explicit`` names the algorithm keys the user set (``load_config`` knows them), so that an
    explicit value equal to the default (``algorithm.kl_coef=0`` with ``name=ppo``) is kept; without
    it, a field still equal to its default counts as unset.
    """
    if cfg.name not in RECIPES:
        try:
            RECIPES.get(cfg.name)
        except KeyError as exc:
            raise ConfigError(f"algorithm.name: {exc.args[0]}") from None
    recipe = dict(RECIPES.get(cfg.name))
    defaults = AlgorithmConfig()
    updates = {}
    for key, value in recipe.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"recipe {cfg.name!r} sets unknown algorithm key {key!r}")
        unset = key not in explicit if explicit is not None else getattr(cfg, key) == getattr(defaults, key)
        if unset:
            updates[key] = value
    return dataclasses.replace(cfg, **updates)


def _check_name(cfg: AlgorithmConfig) -> AlgorithmConfig:
    try:
        RECIPES.get(cfg.name)
    except KeyError as exc:
        raise ConfigError(f"algorithm.name: {exc.args[0]}") from None
    return cfg


def resolve_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    # A config from load_config has its recipe applied already (every recipe sets both).
    cfg = apply_recipe(cfg) if not (cfg.advantage and cfg.loss) else cfg
    check_algorithm(cfg)
    needs = set(_meta(OBJECTIVES, cfg.loss, "needs", cfg)) | set(_meta(ADVANTAGES, cfg.advantage, "needs", cfg))
    if cfg.kl_coef > 0:
        needs.add("ref_log_prob")
        if cfg.kl_in == "reward" or cfg.kl_target is not None:
            needs.add("old_log_prob")  # the KL of the sampled tokens, before the update
    if cfg.safe.enabled:  # SAFE's gated KL (algorithms/safe.py) reads the reference's log-probs
        needs.add("ref_log_prob")
    if cfg.ref_reset_every > 0 and "ref_log_prob" not in needs:
        # ProRL's reset (trainer/ref_reset.py) replaces the reference model: without a term that
        # reads it no reference is loaded, and the setting would silently do nothing.
        raise ConfigError(f"algorithm.ref_reset_every={cfg.ref_reset_every} resets the KL reference policy, but "
                          f"this algorithm (loss={cfg.loss!r}, advantage={cfg.advantage!r}, kl_coef={cfg.kl_coef:g}) "
                          "uses no reference model: set algorithm.kl_coef > 0, or leave ref_reset_every at 0")
    if cfg.ppo_epochs > 1:
        needs.add("old_log_prob")
    # UCAS / ProGRPO (algorithms/ucas.py, progrpo.py) read π_old's forward of the rollout: its
    # log-probs (ProGRPO's answer confidence) and, for UCAS, vocabulary statistics from the same pass.
    if cfg.ucas or cfg.progrpo_alpha > 0:
        needs.add("old_log_prob")
    # PPL shaping (algorithms/ppl_position.py) reads each response's log-perplexity under π_old.
    if cfg.ppl_shaping_coef > 0:
        needs.add("old_log_prob")
    # ER/ERV/ERA shaping (algorithms/er_shaping.py) reads the last hidden states of the update's forward.
    if cfg.er_shaping_coef > 0:
        needs.add("hidden")
    # ALP (algorithms/alp.py): π_old must be the unperturbed model's forward; its per-layer σ is an extra head.
    needs.update(alp_needs(cfg))
    adv_meta, obj_meta = ADVANTAGES.meta(cfg.advantage), OBJECTIVES.meta(cfg.loss)
    factories = {**_meta(ADVANTAGES, cfg.advantage, "modules", cfg), **_meta(OBJECTIVES, cfg.loss, "modules", cfg),
                 **alp_modules(cfg)}
    aux = tuple(m["aux_loss"] for m in (adv_meta, obj_meta) if m.get("aux_loss") is not None)
    return Algorithm(cfg=cfg, advantage=ADVANTAGES.get(cfg.advantage),
                     objective=OBJECTIVES.get(cfg.loss), needs=frozenset(needs), module_factories=factories,
                     aux_losses=aux, er_shaping=build_er_shaping(cfg), siren=build_siren(cfg),
                     epo=build_epo(cfg), safe=build_safe(cfg),
                     precompute=obj_meta.get("precompute"),
                     # TRLOO's per-attempt grades, GiGPO's environment turns (algorithms/gigpo.py), from the rollout
                     advantage_inputs={**trloo_inputs(cfg), **gigpo_inputs(cfg), **turn_credit_inputs(cfg),
                                       **hiper_inputs(cfg),  # HiPER's environment turns (algorithms/hiper.py)
                                       **rose_inputs(cfg),  # ROSE's tree rows (algorithms/rose.py)
                                       **deepsearch_inputs(cfg)},  # DeepSearch's node values (algorithms/deepsearch.py)
                     # Lp-Reg's selection is per micro-batch, which leaving rows out would change; KDRL's
                     # teacher KL (algorithms/kdrl.py) has a gradient on rows whose advantage is 0.
                     # SIREN's entropy term (algorithms/siren.py) too, and its per-micro-batch mean.
                     inert_at_zero_advantage=bool(obj_meta.get("inert_at_zero_advantage")) and cfg.lp_reg_coef == 0
                     and not kdrl_on(cfg) and cfg.siren_coef == 0
                     # EPO's band penalty (algorithms/epo.py) acts on the entropy of rows whose Â is 0.
                     and cfg.epo_coef == 0
                     # RLFR's flow term (trainer/latent_flow_step.py) gives rows whose estimator Â is 0 an advantage.
                     and not cfg.rlfr.enabled
                     # SAFE's gated KL (algorithms/safe.py) has a gradient on rows whose Â is 0.
                     and not cfg.safe.enabled
                     # SRPO's distillation (algorithms/srpo.py) trains the failed rows, whose advantage it zeroes.
                     and cfg.srpo_coef == 0)


def check_algorithm(cfg: AlgorithmConfig) -> None:
    """Every check of the algorithm section alone (its recipe applied): the registered names, then the
    ranges and refused combinations. Run at config load and at train() start (config_checks.check_whole_config)
    and again by resolve_algorithm, for an AlgorithmConfig resolved on its own."""
    # The algorithm options set while their method is off (config_checks._GATED), for a resolve_algorithm
    # called directly; imported here: config_checks imports this module.
    from anabranch.config_checks import refuse_inactive_algorithm_keys

    refuse_inactive_algorithm_keys(cfg)
    _check_name(cfg)
    for key, registry in (("advantage", ADVANTAGES), ("loss", OBJECTIVES)):
        name = getattr(cfg, key)
        try:
            registry.get(name)
        except KeyError as exc:
            raise ConfigError(f"algorithm.{key}: {exc.args[0]}") from None
    if cfg.loss_agg_mode not in MODES:
        raise ConfigError(f"algorithm.loss_agg_mode {cfg.loss_agg_mode!r} is not one of {MODES}")
    if cfg.kl_estimator not in ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator {cfg.kl_estimator!r} is not one of {ESTIMATORS}")
    check_ranges(cfg)
    if OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"):
        _check_reward_target(cfg)


def check_ranges(cfg: AlgorithmConfig) -> None:
    checks = [
        (cfg.kl_in in ("loss", "reward"), "kl_in", "must be 'loss' or 'reward'"),
        (0 <= cfg.clip_ratio_low <= 1, "clip_ratio_low", "must be in [0, 1] (the ratio's floor is 1 − clip_ratio_low)"),
        (cfg.clip_ratio_high >= 0, "clip_ratio_high", "must be >= 0"),
        (cfg.kl_target is None or cfg.kl_target > 0, "kl_target", "must be positive (or null for a fixed kl_coef)"),
        # The controller scales β multiplicatively from kl_coef: from 0 it stays 0, and with
        # kl_coef = 0 no reference model is loaded, so the target would be silently ignored.
        (cfg.kl_target is None or cfg.kl_coef > 0, "kl_target",
         "needs algorithm.kl_coef > 0, the initial β that the adaptive controller scales (from 0 it stays 0)"),
        (cfg.kl_horizon > 0, "kl_horizon", "must be positive"),
        (cfg.ref_reset_every >= 0, "ref_reset_every", "must be >= 0 (0 turns the reference reset off)"),
        (cfg.clip_ratio_c == 0 or cfg.clip_ratio_c > 1, "clip_ratio_c", "must be 0 (off) or > 1"),
        (0 < cfg.entropy_top_rho <= 1, "entropy_top_rho", "must be in (0, 1]"),
        # DSDR (algorithms/dsdr.py): a bonus below the unit correctness reward; a regularizer of
        # group-advantage policy gradients, not of FlowRL/FDPG's reward-distribution targets.
        (0 <= cfg.dsdr_global_coef < 1, "dsdr_global_coef",
         "must be in [0, 1): DSDR's diversity bonus stays below the unit correctness reward (0 is off)"),
        (cfg.dsdr_local_coef >= 0, "dsdr_local_coef", "must be >= 0 (0 turns DSDR's local entropy term off)"),
        (cfg.dsdr_tau > 0, "dsdr_tau", "must be positive, the temperature of DSDR's coupling softmax"),
        (0 <= cfg.dsdr_formula_weight <= 1, "dsdr_formula_weight", "must be in [0, 1]"),
        (cfg.dsdr_similarity in ("embedding", "ngram"), "dsdr_similarity", "must be 'embedding' or 'ngram'"),
        *[(getattr(cfg, key) == 0 or not OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"), key,
           f"(DSDR) regularizes a group-advantage policy gradient, not loss={cfg.loss!r}; leave it at 0")
          for key in ("dsdr_global_coef", "dsdr_local_coef")],
        (cfg.entropy_adv_alpha >= 0, "entropy_adv_alpha", "must be >= 0"),
        (cfg.entropy_adv_kappa > 0, "entropy_adv_kappa", "must be positive"),
        (cfg.lp_reg_coef >= 0, "lp_reg_coef", "must be >= 0 (0 turns Lp-Reg off)"),
        (0 < cfg.lp_reg_rho <= 1, "lp_reg_rho", "must be in (0, 1], the share of negative-advantage tokens taken"),
        (0 < cfg.lp_reg_kappa < 1, "lp_reg_kappa", "must be in (0, 1), the min-p threshold's fraction of max π"),
        (0 <= cfg.lp_reg_tau < 1, "lp_reg_tau", "must be in [0, 1) (0: the relative threshold lp_reg_kappa)"),
        # Lp-Reg pulls the tokens of negative-advantage samples; FlowRL/FDPG read a reward from the
        # advantage (never a signed token advantage) and fit a sequence-level target.
        (cfg.lp_reg_coef == 0 or not OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"), "lp_reg_coef",
         f"(Lp-Reg) needs a token-level objective with signed advantages, not loss={cfg.loss!r}; leave it at 0"),
        (0 <= cfg.gamma <= 1 and 0 <= cfg.lam <= 1, "gamma/lam", "must be in [0, 1]"),
        (cfg.vf_clip >= 0, "vf_clip", "must be >= 0 (0 turns value clipping off)"),
        (cfg.max_sample_batches >= 1, "max_sample_batches", "must be >= 1"),
        (cfg.dynamic_sampling_metric in ("accuracy", "reward"), "dynamic_sampling_metric",
         "must be 'accuracy' or 'reward'"),
        (cfg.overlong_buffer >= 0, "overlong_buffer", "must be >= 0"),
        # ROVER (algorithms/rover.py): the temperature of Q = ρ·(log π_θ − log π_old); nan fails both tests.
        (0 < cfg.rover_rho < float("inf"), "rover_rho", "must be positive and finite"),
    ]
    for ok, key, why in checks:
        if not ok:
            value = getattr(cfg, key, None) if "/" not in key else (cfg.gamma, cfg.lam)
            raise ConfigError(f"algorithm.{key} {why} (got {value!r})")
    for target, section in _METHOD_RANGE_CHECKS:  # in order: the first refusal is the one reported
        check = _import_check(target) if isinstance(target, str) else target
        error = check(getattr(cfg, section) if section else cfg)
        if error:
            raise ConfigError(error)


def _import_check(target: str) -> Callable:
    """``"module:function"`` imported at call time (the method modules import from this one)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _finite_numbers(cfg: AlgorithmConfig) -> str | None:
    # NGRPO / ACE (algorithms/ngrpo.py, algorithms/ace.py): abs(x) < inf is False for nan and ±inf.
    if not abs(cfg.ngrpo_max_reward) < float("inf"):
        return (f"algorithm.ngrpo_max_reward must be a finite number, the reward of NGRPO's virtual "
                f"best sample (got {cfg.ngrpo_max_reward!r})")
    if not (abs(cfg.ace_alpha) < float("inf") and cfg.ace_alpha >= 0):
        return (f"algorithm.ace_alpha must be a finite number >= 0 (0 turns ACE's confidence "
                f"penalty off; got {cfg.ace_alpha!r})")
    return None


def _reshaping_needs_linear_loss(cfg: AlgorithmConfig) -> str | None:
    # UCAS / ProGRPO reshape the advantages (algorithms/ucas.py, algorithms/progrpo.py).
    for on, key in ((cfg.ucas, "ucas"), (cfg.progrpo_alpha > 0, "progrpo_alpha")):
        if on and OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"):
            return (f"algorithm.{key}: reshaping the advantages suits losses linear in the advantage "
                    f"(PPO, GRPO, CISPO), not loss={cfg.loss!r}, which reads the reward back from them; "
                    f"leave algorithm.{key} at its default")
    return None


def _shaping_needs_linear_loss(cfg: AlgorithmConfig) -> str | None:
    # The PPL/position shaping (algorithms/ppl_position.py) rescales the advantages.
    for key in ("ppl_shaping_coef", "position_shaping_coef"):
        if getattr(cfg, key) > 0 and OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"):
            return (f"algorithm.{key}: rescaling the advantages suits losses linear in the advantage "
                    f"(PPO, GRPO, CISPO), not loss={cfg.loss!r}, which reads the reward back from them; "
                    f"leave algorithm.{key} at 0")
    return None


def _advantage_options_unread(cfg: AlgorithmConfig) -> str | None:
    # The options that only reshape advantages do nothing with an objective that never reads them (ReasonMaxxer,
    # PACS, OREAL: labels from the rewards); SRPO and DSDR's local term act but need the advantages, DSDR's reward
    # bonus would change the labels (their reasons in ADVANTAGE_OPTION_REASONS). PACS's own check (before) names
    # its label first.
    if OBJECTIVES.meta(cfg.loss).get("ignores_advantages"):
        for key, on in ADVANTAGE_OPTIONS:
            if on(cfg):
                why = ADVANTAGE_OPTION_REASONS.get(key, "so this option would do nothing")
                return (f"algorithm.{key}={getattr(cfg, key)!r} with algorithm.loss={cfg.loss}: this loss "
                        f"never reads the advantages (it computes its labels from the rewards itself), {why}; "
                        f"leave algorithm.{key} at its default")
    return None


def _hpt_never_acts(cfg: AlgorithmConfig) -> str | None:
    if cfg.hpt.enabled and cfg.dynamic_sampling and cfg.dynamic_sampling_metric == "accuracy" and cfg.hpt.gamma == 0:
        return ("algorithm.hpt.gamma=0 with algorithm.dynamic_sampling: dynamic sampling drops the groups "
                "with no correct sample, the only ones HPT would switch to SFT, so HPT would never act; "
                "set algorithm.dynamic_sampling=false or a positive algorithm.hpt.gamma")
    return None


def _rl_plus_combinations(cfg: AlgorithmConfig) -> str | None:
    if cfg.rl_plus.enabled and cfg.hpt.enabled:
        return ("algorithm.rl_plus.enabled with algorithm.hpt.enabled: both train each prompt's "
                "demonstration (RL-PLUS as an importance-weighted policy-gradient term, HPT as SFT in place "
                "of RL), so the demonstration would be trained twice under two rules; turn one of them off")
    if cfg.rl_plus.enabled and OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"):
        return (f"algorithm.rl_plus.enabled: RL-PLUS adds a policy-gradient term r_t·Â·C_t beside a loss "
                f"linear in the advantage (PPO, GRPO, CISPO, ...), not loss={cfg.loss!r}, which reads the "
                f"reward back from its advantages; set algorithm.rl_plus.enabled=false or another loss")
    return None


def _srpo_needs_linear_loss(cfg: AlgorithmConfig) -> str | None:
    # SRPO zeroes the failed rows' advantages, which only takes them out of a loss linear in the advantage.
    if cfg.srpo_coef > 0 and OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"):
        return (f"algorithm.srpo_coef > 0 with loss={cfg.loss!r}: SRPO routes failed samples out of the "
                "policy-gradient term by zeroing their advantage, which a loss that reads the reward back "
                "from its advantages would take as a target; use a policy-gradient loss (e.g. "
                "algorithm.name=grpo) or set algorithm.srpo_coef=0")
    return None


def _spae_needs_linear_loss(cfg: AlgorithmConfig) -> str | None:
    # SPAE shifts each token's advantage, which suits only losses linear in the advantage.
    if cfg.spae_coef > 0 and OBJECTIVES.meta(cfg.loss).get("advantage_is_reward"):
        return (f"algorithm.spae_coef > 0 with loss={cfg.loss!r}: SPAE adds a per-token term to the "
                "advantages, which a loss that reads the reward back from them would take as a target; use "
                "a policy-gradient loss (e.g. algorithm.name=grpo) or set algorithm.spae_coef=0")
    if cfg.spae_coef > 0 and OBJECTIVES.meta(cfg.loss).get("ignores_advantages"):
        # Its probe forward would run every step and change advantages that this loss never reads.
        return (f"algorithm.spae_coef > 0 with loss={cfg.loss!r}: this loss never reads the advantages "
                "(its labels come from the rewards), so SPAE's term would change nothing while its probe "
                "pass still ran every step; use a policy-gradient loss (e.g. algorithm.name=grpo) or set "
                "algorithm.spae_coef=0")
    return None


def _kdrl_group_mask_never_acts(cfg: AlgorithmConfig) -> str | None:
    # mask=group distils only prompts with no correct sample: the very groups that dynamic sampling on
    # right/wrong drops and that HPT (accuracy <= gamma) takes out of the RL loss, so it would never act.
    if cfg.kdrl.teacher and cfg.kdrl.mask == "group":
        if cfg.dynamic_sampling and cfg.dynamic_sampling_metric == "accuracy":
            return ("algorithm.kdrl.mask=group with algorithm.dynamic_sampling (metric 'accuracy'): dynamic "
                    "sampling drops the groups with no correct sample, the only ones this mask distils, so "
                    "the teacher term would never act; use algorithm.kdrl.mask=response or turn dynamic "
                    "sampling off")
        if cfg.hpt.enabled:
            return ("algorithm.kdrl.mask=group with algorithm.hpt.enabled: HPT takes the groups with no "
                    "correct sample out of the RL loss, the only ones this mask distils, so the teacher term "
                    "would never act; use algorithm.kdrl.mask=response or turn HPT off")
    return None


# check_ranges' method checks, run in this order after the range table: (check, section), the check a function or
# "module:function" (imported when run), called with the algorithm config or its ``section``; each returns the
# refusal text or None (or raises ConfigError). A new method's check is one row here.
_METHOD_RANGE_CHECKS: tuple[tuple[Callable | str, str], ...] = (
    (_finite_numbers, ""),
    ("anabranch.algorithms.ucas:check_ucas", ""),
    ("anabranch.algorithms.progrpo:check_progrpo", ""),
    (_reshaping_needs_linear_loss, ""),
    ("anabranch.trainer.std_filter:check_std_filter", ""),  # RLPR's std filter for dynamic sampling
    # Weighted GRPO's λ_neg; its need of task.pairing is checked with the whole config (config_checks).
    ("anabranch.algorithms.weighted_grpo:check_weighted_grpo", ""),
    ("anabranch.algorithms.etr:check_etr", ""),  # ETR's elastic clip
    ("anabranch.algorithms.pacs:check_pacs", ""),  # PACS's score
    ("anabranch.algorithms.refuel:check_refuel", ""),  # REFUEL's η
    ("anabranch.algorithms.mssr:check_mssr", ""),  # MSSR's tracker
    ("anabranch.algorithms.ppl_position:check_ppl_position", ""),
    (_shaping_needs_linear_loss, ""),
    ("anabranch.algorithms.trloo:check_trloo", ""),  # the terms its per-attempt rewards would drop
    ("anabranch.algorithms.canon:check_canon", ""),  # CANON's split metric and inter-group weight
    ("anabranch.algorithms.brain:check_brain", ""),  # BRAIn's temperature; refused with any other loss
    ("anabranch.algorithms.oreal:check_oreal", ""),
    (_advantage_options_unread, ""),
    (check_alp, ""),  # ALP's noise scales and a loss with a ratio to perturb (raises)
    ("anabranch.algorithms.steer:check_steer", ""),
    ("anabranch.algorithms.aepo:check_aepo", ""),
    (check_er_shaping, ""),
    (check_siren, ""),
    (check_epo, ""),
    (check_safe, ""),  # SAFE's keys and the fixed KL term it replaces
    ("anabranch.algorithms.double_critic:check_double_critic", ""),  # SAFE's double critic needs a value head
    ("anabranch.algorithms.dph:check_dph", "dph"),  # DPH-RL's rehearsal; any algorithm may add it
    ("anabranch.algorithms.hpt:check_hpt", "hpt"),  # HPT's switch between RL and SFT per prompt
    (_hpt_never_acts, ""),
    ("anabranch.algorithms.guide:check_guide", ""),  # Guide's hints for all-fail prompts
    ("anabranch.algorithms.scaffold:check_scaffold", ""),  # GHPO's hint scaffolding
    ("anabranch.algorithms.ampo:check_ampo", ""),  # AMPO's teacher injection for all-fail groups
    ("anabranch.algorithms.scope:check_scope", ""),  # SCOPE's step-wise rewrites of failed samples
    ("anabranch.algorithms.svs:check_svs", ""),  # SvS's variational problem synthesis
    ("anabranch.algorithms.ssp:check_ssp", ""),  # Search Self-play's proposer/solver rounds
    ("anabranch.algorithms.calibrl:check_calibrl", ""),  # CalibRL's expert-baseline term
    ("anabranch.algorithms.rl_plus:check_rl_plus", "rl_plus"),
    (_rl_plus_combinations, ""),
    ("anabranch.algorithms.srpo:check_srpo", ""),
    (_srpo_needs_linear_loss, ""),
    ("anabranch.algorithms.spae:check_spae", ""),
    (_spae_needs_linear_loss, ""),
    ("anabranch.algorithms.rltf_sd:check_rltf_sd", ""),  # rollout.retry_turns is checked at config load
    ("anabranch.algorithms.reasonmaxxer:check_reasonmaxxer", ""),
    ("anabranch.algorithms.kdrl:check_kdrl", "kdrl"),  # the teacher's path and vocabulary: when it loads
    (_kdrl_group_mask_never_acts, ""),
    ("anabranch.algorithms.tcod:check_tcod", ""),  # TCOD's curriculum ranges and KDRL's teacher
)


def _check_reward_target(cfg: AlgorithmConfig) -> None:
    """An objective that reads the reward r̂ back from its advantages (FlowRL's target β·r̂ inside a
    square) cannot take the per-token rescalings that are built for losses linear in the advantage:
    a TIS weight or an entropy bonus would move its target instead of weighting its gradient, and
    the forking-token mask would zero most of r̂."""
    for on, key, what in ((cfg.tis_cap > 0, "tis_cap", "truncated importance weights"),
                          (cfg.entropy_adv_alpha > 0, "entropy_adv_alpha", "the entropy-shaped advantage"),
                          (cfg.entropy_top_rho < 1, "entropy_top_rho", "the high-entropy token mask")):
        if on:
            note = " (the sampler mismatch is still logged)" if key == "tis_cap" else ""
            raise ConfigError(f"algorithm.{key}: {what} would rescale each token's advantage, which suits losses "
                              f"linear in the advantage (PPO, GRPO, CISPO) but not loss={cfg.loss!r}: it reads the "
                              f"reward r̂ back from the advantages and squares it in its target; leave "
                              f"algorithm.{key} at its default{note}")


def _meta(registry, name: str, key: str, cfg: AlgorithmConfig):
    """A registration's ``needs`` / ``modules``: a fixed value, or a function of the algorithm config
    for objectives whose inputs depend on their options (FlowRL needs a reference model only with
    ``flowrl.reference=ref``); such a function may raise ConfigError for bad options."""
    value = registry.meta(name).get(key, {} if key == "modules" else ())
    return value(cfg) if callable(value) else value
