"""Hint scaffolding (GHPO): prompts the policy fails get a growing prefix of their reference solution in
the prompt, and the hinted prompt is the training context.

Paper: Ziru Liu, Cheng Gong, Xinyu Fu, Yaofang Liu, Ran Chen, Shoubo Hu, Suiyun Zhang, Rui Liu, Qingfu Zhang,
Dandan Tu, "GHPO: Adaptive Guidance for Stable and Efficient LLM Reinforcement Learning" (2025, arXiv
2507.10628). GHPO detects the difficult prompts (all G samples of a group get reward 0) and refines them:
the question q is followed by the first fraction ω of the ground-truth solution y*,

    q̃ = q ⊕ h_ω(y*),   h_ω(y*) = the first ⌈ω·|y*|⌉ units of y*,

with ω raised stage by stage on a linear schedule (0.25 → 0.5 → 0.75) while the group still has no correct
sample. The refined groups are trained on-policy in their refined context: with the GRPO objective

    J = E[ agg_t min(r_t Â_i, clip(r_t, 1 − ε_low, 1 + ε_high) Â_i) ],
    r_t = π_θ(o_t | q̃, o_<t) / π_old(o_t | q̃, o_<t),

Â_i the group-normalized reward of the refined group's own samples. Unlike Guide (algorithms/guide.py),
no ratio toward the hint-free context is taken: the hint part of the prompt is context like the question.

How this library realises it (trainer/scaffold_step.py): after the step's rollouts are scored, each group
with no correct sample (full credit on the correctness reward, or on the total reward when no reward says
right/wrong, as Guide and HPT count it) is sampled again, ``rollout.n`` plain samples (also in CURE's
stage 1, ``rollout.extra_rollouts=cure``: its critical-token branches are for the step's own prompts; a
hinted group of n plain samples has the size of CURE's groups), with the hint of stage 1
(ω = ``algorithm.scaffold.ratios[0]``); the groups still without a correct sample go to stage 2, and so on
to the last ratio. Each hinted group *replaces* the failed one, with the samples of the last stage it
reached and the hinted prompt's tokens as its context, so π_old (and any old log-probs the objective
reads) is the policy on [q̃ | o], as for any on-policy sample.

What is assumed (the paper's method section could not be read here; its abstract, the catalog and
secondary summaries could):
- the stages are retries within the training step (a group that still fails at ω_k is re-sampled at
  ω_{k+1}); a schedule over training steps is not implemented;
- the unit of ω is a whitespace-separated word of the solution (tokenizer-free, so the same text on every
  backend): k = ⌈ω·W⌉ words of W, at least 1, the text kept up to the end of the k-th word;
- a group that fails at every stage is trained with its last stage's samples (all wrong: no signal under
  a group baseline, as an all-wrong group in GRPO);
- the hint's wording (``algorithm.scaffold.hint_template``) is this library's, placed after the question
  in the user turn as Guide's hint.

``algorithm.scaffold.schedule=irt`` replaces the fixed stages by SEELE's IRT-fitted hint length
(algorithms/hint_irt.py, trainer/scaffold_irt.py); the hint text and the step are shared.
"""

from __future__ import annotations

import math
import re

from anabranch.range_checks import first_failed

_WORD = re.compile(r"\S+")


def solution_words(row: dict) -> int:
    """W: the number of whitespace-separated words of the row's solution (``row["demonstration"]``; 0 without)."""
    return len(_WORD.findall(row.get("demonstration") or ""))


def solution_prefix(solution: str, ratio: float) -> str:
    """The first ⌈ratio·W⌉ whitespace-separated words of ``solution`` (W words, at least one word), with
    the solution's own spacing between them; "" for an empty solution."""
    words = list(_WORD.finditer(solution or ""))
    if not words:
        return ""
    # − 1e-9: ω·W computed in floating point (0.1·30 = 3.0000000000000004) must not round up a whole word.
    k = min(len(words), max(1, math.ceil(ratio * len(words) - 1e-9)))
    return solution[words[0].start():words[k - 1].end()]


def scaffold_hint(row: dict, ratio: float, template: str) -> str | None:
    """``template`` with ``{prefix}`` replaced by the row's solution prefix at ``ratio``; None when the row
    has no solution (``row["demonstration"]``, filled from ``task.demonstration_column``)."""
    solution = row.get("demonstration")
    if not isinstance(solution, str) or not solution.strip():
        return None
    return template.replace("{prefix}", solution_prefix(solution, ratio))


def _ratios_ok(ratios) -> bool:
    if not isinstance(ratios, (list, tuple)) or not ratios:
        return False
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r <= 1 for r in ratios):
        return False
    return all(a < b for a, b in zip(ratios, ratios[1:]))


def check_scaffold(cfg) -> str | None:
    """The first problem with ``cfg.scaffold`` (``cfg``: an AlgorithmConfig), alone or with the rest of the
    algorithm config, or None (resolve.check_ranges). Its knobs set while it is off are refused by
    config_checks._GATED."""
    s = cfg.scaffold
    checks = [
        (isinstance(s.enabled, bool), "enabled", "must be true or false"),
        (_ratios_ok(s.ratios), "ratios",
         "must be a non-empty, strictly increasing list of hint ratios ω in (0, 1], e.g. [0.25, 0.5, 0.75]"),
        (isinstance(s.hint_template, str) and "{prefix}" in s.hint_template, "hint_template",
         "must be a text containing {prefix}, where the solution's prefix goes"),
    ]
    if (error := first_failed(checks, "algorithm.scaffold", s)) is not None:
        return error
    if not s.enabled:
        return None
    from anabranch.algorithms.hint_irt import check_irt  # SEELE's IRT hint length (schedule=irt)

    error = check_irt(s)
    if error:
        return error
    if cfg.guide.enabled:
        return ("algorithm.scaffold.enabled with algorithm.guide.enabled: both re-sample the prompts with no correct "
                "sample with a hint (Guide trains them for the hint-free prompt, scaffolding in the hinted one); "
                "turn one of them off")
    if cfg.advantage == "mssr":
        # MSSR's per-prompt tracker would take the hinted successes into the hint-free prompt's baseline.
        return ("algorithm.scaffold.enabled with algorithm.advantage='mssr': MSSR's per-prompt success tracker would "
                "count the hinted samples as the prompt's own; use a group estimator (grpo, rloo, ...) or set "
                "algorithm.scaffold.enabled=false")
    if cfg.dynamic_sampling:
        return ("algorithm.scaffold.enabled with algorithm.dynamic_sampling: dynamic sampling drops the groups whose "
                "samples are all wrong before scaffolding sees them, the only ones it hints; set "
                "algorithm.dynamic_sampling=false or algorithm.scaffold.enabled=false")
    if cfg.hpt.enabled:
        return ("algorithm.scaffold.enabled with algorithm.hpt.enabled: both act on the prompts with no correct "
                "sample (scaffolding samples again with a solution prefix, HPT trains their demonstration instead "
                "of RL); turn one of them off")
    return None


def check_run(cfg) -> None:
    """Combinations of the whole config refused before any model loads (config_checks): the
    backend, tools and pairing refusals it shares with Guide (algorithms/guide.py)."""
    from anabranch.algorithms.guide import refuse_hint_resampling

    if cfg.algorithm.scaffold.enabled:
        refuse_hint_resampling(cfg, "algorithm.scaffold.enabled", "scaffolding")
