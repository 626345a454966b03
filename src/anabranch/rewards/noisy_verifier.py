"""Correction of a noisy binary verifier: a reward wrapped around another reward.

Cai, Wang, Liu, Liu, Niu, Sugiyama 2025, "Reinforcement Learning with Verifiable yet Noisy Rewards
under Imperfect Verifiers". The verifier is a noisy channel from the true reward R* ∈ {0, 1} to the
observed R̃ ∈ {0, 1} with false-positive rate ρ0 = P(R̃ = 1 | R* = 0) and false-negative rate
ρ1 = P(R̃ = 0 | R* = 1), so E[R̃ | R*] = ρ0 + (1 − ρ0 − ρ1)·R*.

* ``mode=backward`` — the de-biased reward R̂ = (R̃ − ρ0) / (1 − ρ0 − ρ1), with E[R̂ | R*] = R*:
  an unbiased surrogate reward, hence an unbiased policy-gradient estimate.
* ``mode=forward`` — the score-function term R̃·∇log π is replaced by w_{R̃}·∇log π with
  w_1 = ρ1 and w_0 = ρ1 − 1, i.e. the value w = R̃ + ρ1 − 1. Then E[w | R* = 1] = 0 and
  E[w | R* = 0] = −(1 − ρ0 − ρ1), so the expected update is (1 − ρ0 − ρ1) times the clean gradient
  (Σ_y π∇log π = 0): the same direction, knowing only the FN rate ρ1. Here w is given to the trainer
  as the sample's reward, which is exactly that reweighting for a plain policy gradient; the
  paper's exact hook inside GRPO was not found, so this is our reading of it.

Both are affine in R̃ with fixed rates. Any advantage that subtracts a group mean and divides by
the group std (GRPO, ``norm_adv_by_std=true``) or whitens over the batch (REINFORCE++ with γ = 1
and no KL in the reward) is invariant to a positive affine map, so the correction changes nothing
there (up to the std epsilon). It scales the advantages by 1/(1 − ρ0 − ρ1) under mean-only
baselines (Dr. GRPO, RLOO), changes a no-baseline policy gradient, and changes the weight of the
reward against a KL penalty in the reward. ``tests/test_noisy_verifier.py`` checks each case.

Config: ``{name: noisy_verifier, params: {reward: math_verify, false_positive_rate: 0.1,
false_negative_rate: 0.2, mode: backward, reward_params: {...}}}``. The wrapped reward runs inside
this one's call (same deadline and isolation); a reward that needs the live trainer (``judge``:
use ``reward.isolation=thread``) or trainer-computed fields (intrinsic rewards, ``rlpr``) cannot
be wrapped. At the start, ``check_params`` also runs the wrapped reward's own ``check_params`` on
``reward_params``, and the wrapped reward's row fields are reported as this one's
(``wrapped_row_fields``), so the run's start-time check of the task's rows covers them.
"""

from __future__ import annotations

import math

from anabranch.config import ConfigError
from anabranch.rewards.guard import RewardOutput
from anabranch.rewards.registry import REWARDS

MODES = ("backward", "forward")
_KEY = "reward.functions[noisy_verifier].params"
# Inner rewards whose inputs only the trainer computes, on request of the listed source's meta:
# wrapped, they would never get them.
_TRAINER_FIELD_META = ("needs_token_stats", "needs_policy_forward")


def check_params(params: dict) -> None:
    """Raise :class:`ConfigError` naming the offending key when ``params`` are invalid."""
    inner = params.get("reward")
    if not isinstance(inner, str) or not inner:
        raise ConfigError(f"{_KEY}.reward: name the verifier to correct, e.g. reward: math_verify (got {inner!r})")
    if inner == "noisy_verifier":
        raise ConfigError(f"{_KEY}.reward: noisy_verifier cannot wrap itself")
    try:
        meta = REWARDS.meta(inner)
    except (KeyError, ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{_KEY}.reward: {exc.args[0] if exc.args else exc}") from None
    if any(meta.get(k) for k in _TRAINER_FIELD_META):
        raise ConfigError(f"{_KEY}.reward: {inner!r} needs fields only the trainer computes; it cannot be wrapped")
    mode = params.get("mode", "backward")
    if mode not in MODES:
        raise ConfigError(f"{_KEY}.mode must be one of {', '.join(MODES)} (got {mode!r})")
    rates = {}
    for key in ("false_positive_rate", "false_negative_rate"):
        value = params.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0.0 <= value < 1.0:
            raise ConfigError(f"{_KEY}.{key} must be a number in [0, 1) (got {value!r})")
        rates[key] = float(value)
    if rates["false_positive_rate"] + rates["false_negative_rate"] >= 1.0:
        raise ConfigError(f"{_KEY}: false_positive_rate + false_negative_rate must be < 1 (got "
                          f"{rates['false_positive_rate']} + {rates['false_negative_rate']}); at 1 the "
                          "verifier carries no information about correctness")
    if not isinstance(params.get("reward_params", {}), dict):
        raise ConfigError(f"{_KEY}.reward_params must be a mapping (got {params.get('reward_params')!r})")
    # The wrapped reward's own options are checked at the start too, as they would be unwrapped
    # (compose.build_rewards runs a source's check_params; here the source is this wrapper).
    inner_check = meta.get("check_params")
    if inner_check is not None:
        try:
            inner_check(dict(params.get("reward_params", {})))
        except ConfigError as exc:
            raise ConfigError(f"{_KEY}.reward_params (options of the wrapped {inner!r}): {exc}") from None


def backward_correction(values, fp_rate: float, fn_rate: float) -> list[float]:
    """R̂ = (R̃ − ρ0) / (1 − ρ0 − ρ1) for each observed reward R̃."""
    scale = 1.0 - fp_rate - fn_rate
    return [(float(v) - fp_rate) / scale for v in values]


def forward_weights(values, fn_rate: float) -> list[float]:
    """w_{R̃} = R̃ + ρ1 − 1: w_1 = ρ1, w_0 = ρ1 − 1."""
    return [float(v) + fn_rate - 1.0 for v in values]


def wrapped_row_fields(params: dict) -> tuple:
    """The wrapped reward's row fields, so the run's start-time check covers them (compose.check_row_fields)."""
    inner = REWARDS.meta(params.get("reward")).get("row_fields", ()) if params.get("reward") in REWARDS else ()
    return tuple(inner(params.get("reward_params", {})) if callable(inner) else inner)


@REWARDS.register("noisy_verifier", check_params=check_params, row_fields=wrapped_row_fields)
def noisy_verifier_reward(prompts, completions, reward=None, false_positive_rate=0.0, false_negative_rate=0.0,
                          mode="backward", reward_params=None, **fields):
    """The wrapped reward's values, corrected for its FP/FN rates (see the module docstring)."""
    params = dict(reward=reward, false_positive_rate=false_positive_rate, false_negative_rate=false_negative_rate,
                  mode=mode, reward_params=reward_params or {})
    check_params(params)  # also here: a direct call, or a build path that does not run check_params
    out = REWARDS.get(reward)(prompts, completions, **{**fields, **params["reward_params"]})
    values, inner_metrics = (out.values, dict(out.metrics)) if isinstance(out, RewardOutput) else (out, {})
    values = [float(v) for v in values]
    if mode == "backward":
        corrected = backward_correction(values, float(false_positive_rate), float(false_negative_rate))
    else:
        corrected = forward_weights(values, float(false_negative_rate))
    metrics = {f"{reward}/{k}": v for k, v in inner_metrics.items()}
    metrics["raw_mean"] = sum(values) / len(values) if values else 0.0
    return RewardOutput(corrected, metrics)
