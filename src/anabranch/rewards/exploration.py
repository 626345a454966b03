"""RLSP's exploration reward: a bounded bonus for reasoning longer or in more steps, apart from the verifier.

Ye, Pham, Zhang, Gopi, Peng, Li, Kulkarni, Inan 2025, "On the Emergence of Thinking in LLMs I: Searching
for the Right Intuition" (arXiv 2502.06773), Reinforcement Learning via Self-Play (RLSP).

``rlsp_exploration`` scores a response y at training step t (the trainer's ``train_step`` field, counted
from 1) as

  e(y)    = min(1, m(y) / M)                          the exploration score, in [0, 1]
  m(y)    = the response's length in tokens            (``measure: length``, M = ``max_length``)
          | its number of distinct non-empty lines     (``measure: steps``,  M = ``max_steps``)
  s(t)    = 1                                          (``decay_steps: 0``, the default)
          | max(0, 1 − (t − 1) / ``decay_steps``)      (a linear decay: full at step 1, 0 from step D + 1)
  r_ex(y) = s(t) · e(y)

and is combined with the verifier by ``reward.functions``' weighted sum, as a source of its own:

  R(y) = w_v · v(y) + w_ex · r_ex(y) (+ any other sources)

The paper's combination, assumed below, α·1[y correct] + (1 − α)·R_ex(y), is w_v = α, w_ex = 1 − α. The length
measure counts tokens when the trainer passes ``response_length`` (it does for training rollouts), else
characters (as ``rewards/length.py``).

Decoupling, and the guard (``check_config``, run at config load): the exploration score never reads the
verifier, and the verifier stays its own source, so accuracy and every "correct" count (dynamic sampling,
``eval/accuracy.py``) still read the verifier alone. A run is refused unless ``reward.functions`` holds a
correctness reward (one registered ``correctness=True``, e.g. ``math_verify``) whose weight exceeds the
sum of the exploration sources' weights, w_ex = Σ w_ex,j (several ``rlsp_exploration`` entries, e.g. one
per measure, can all score 1 on the same long answer), and each exploration weight is > 0. With a right/wrong
verifier (v ∈ {0, 1}) and e ≤ 1 this makes any correct response score above any wrong one, however long:
w_v·1 + 0 > 0 + w_ex·1. (Other sources, e.g. ``format``, are not part of this guarantee.) Exploration can then
only reorder responses of the same correctness, so lengthening an answer can never pay more than getting it
right, which is the reward hacking the verifier is there to prevent. (A partial-credit verifier, e.g.
``code_tests``' fraction of tests passed, gets the weaker guarantee that full credit beats none.) The cap
M bounds the bonus, so length past M earns nothing more.

Confirmed from the paper's abstract (the method text could not be read here): the three steps (SFT on
demonstrations of the reasoning process, an exploration reward signal "to encourage diverse and efficient
reasoning behaviors", RL with an outcome verifier "to ensure correctness while preventing reward hacking");
that exploration and correctness signals are decoupled during PPO training and carefully balanced; that
"the simplest exploration reward that encourages the model to take more intermediate steps" already gave
emergent backtracking, exploration of ideas and verification. Assumed, this library's choices: the
combination as a weighted sum α·correct + (1 − α)·R_ex; the two measures (tokens, and distinct non-empty lines
as "intermediate steps": a repeated line is no new step, so copying lines earns nothing) and their cap M;
the weight guard w_v > w_ex; the optional linear decay of the exploration share (no schedule is confirmed;
``decay_steps: 0`` keeps it constant). A call without ``train_step`` (evaluation, pre-passes, RL-PLUS's
demonstrations) gets the undecayed score, s = 1: the schedule is a training-time share, not a property of
the response. The paper trains with PPO; here the reward serves any estimator (GRPO by default).
"""

from __future__ import annotations

import math

from anabranch.config import ConfigError
from anabranch.rewards.guard import RewardOutput
from anabranch.rewards.length import response_lengths
from anabranch.rewards.registry import REWARDS

NAME = "rlsp_exploration"
MEASURES = ("length", "steps")
DEFAULTS = {"measure": "length", "max_length": 1024, "max_steps": 16, "decay_steps": 0}
# The cap that belongs to each measure; the other one is refused (it would do nothing).
CAP_OF = {"length": "max_length", "steps": "max_steps"}


def step_count(text: str) -> int:
    """Intermediate steps of a response: its distinct non-empty lines (stripped); a repeat is no new step."""
    return len({line.strip() for line in text.splitlines() if line.strip()})


def schedule(step: int | None, decay_steps: int) -> float:
    """s(t): the exploration share at training step ``step`` (from 1); 1 without a step or a decay."""
    if step is None or decay_steps == 0:
        return 1.0
    return max(0.0, 1.0 - (step - 1) / decay_steps)


def _int_at_least(params: dict, key: str, low: int) -> int:
    value = params.get(key, DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"reward.functions[{NAME}].params.{key} must be an integer >= {low} (got {value!r})")
    return value


def check_params(params: dict) -> None:
    """Raise :class:`ConfigError` naming the offending key when ``params`` are invalid."""
    key = f"reward.functions[{NAME}].params"
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown option (known: {', '.join(DEFAULTS)})")
    measure = params.get("measure", DEFAULTS["measure"])
    if measure not in MEASURES:
        raise ConfigError(f"{key}.measure must be one of {', '.join(MEASURES)} (got {measure!r})")
    other = CAP_OF["steps" if measure == "length" else "length"]
    if other in params:
        raise ConfigError(f"{key}.{other} only acts with measure={'steps' if measure == 'length' else 'length'}; "
                          f"with measure={measure} the cap is {CAP_OF[measure]}")
    _int_at_least(params, CAP_OF[measure], 1)
    _int_at_least(params, "decay_steps", 0)


def check_config(cfg) -> None:
    """At config load: each ``rlsp_exploration`` source's options and weight, and the exploration weights'
    *sum* below a correctness reward's weight (the guard in the module docstring: every exploration source
    can score 1 on the same long wrong answer, so together they must stay below what a correct one earns)."""
    import anabranch.rewards  # noqa: F401 - registers the built-in rewards, so their correctness flag is known

    items = list(cfg.reward.functions)
    verifiers = [f for f in items if f.name in REWARDS and REWARDS.meta(f.name).get("correctness")]
    explorers = [f for f in items if f.name == NAME]
    for f in explorers:
        check_params(dict(f.params))
        if not (isinstance(f.weight, (int, float)) and math.isfinite(f.weight) and f.weight > 0):
            raise ConfigError(f"reward.functions[{NAME}].weight must be > 0 (got {f.weight!r}); a length penalty "
                              "is target_length or overlong_penalty, not an exploration reward")
    if not explorers:
        return
    total = sum(f.weight for f in explorers)
    top = max((v.weight for v in verifiers), default=None)
    if top is None or not top > total:
        have = f"its largest weight is {top}" if top is not None else "there is none"
        weight = (f"weight {total}" if len(explorers) == 1 else
                  f"{len(explorers)} entries, weights {' + '.join(str(f.weight) for f in explorers)} = {total}")
        raise ConfigError(f"reward.functions[{NAME}] ({weight}) needs a correctness reward with a larger weight "
                          f"than the exploration weights' sum in reward.functions ({have}), so that no amount of "
                          f"exploration outscores a correct answer: e.g. [{{name: math_verify, weight: 1.0}}, "
                          f"{{name: {NAME}, weight: 0.2}}] (the paper's α·correct + (1 − α)·exploration is "
                          f"math_verify weight α, {NAME} 1 − α, α > 0.5)")


@REWARDS.register(NAME, check_params=check_params)
def rlsp_exploration(prompts, completions, response_length=None, train_step=None, measure="length",
                     max_length=1024, max_steps=16, decay_steps=0, **_):
    """s(t) · min(1, m(y) / M) per response (module docstring); metrics: the mean score e and the share s."""
    if measure == "length":
        raw, cap = response_lengths(completions, response_length), max_length
    else:
        raw, cap = [float(step_count(c)) for c in completions], max_steps
    share = schedule(int(train_step[0]) if train_step else None, decay_steps)
    scores = [min(1.0, m / cap) for m in raw]
    return RewardOutput([share * e for e in scores],
                        {"score_mean": sum(scores) / max(len(scores), 1), "share": share})
