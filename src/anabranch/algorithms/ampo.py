"""AMPO: several teachers' solutions, injected only into the groups the policy fails entirely.

Paper: Xiaoyang Yuan, Yujuan Ding, Yi Bin, Wenqi Shao, Jinyu Cai, Jingkuan Song, Yang Yang, Heng Tao Shen,
"More Than One Teacher: Adaptive Multi-Guidance Policy Optimization for Diverse Exploration"
(2025, arXiv 2510.02227).

Adaptive multi-guidance replacement: a prompt q gets n on-policy samples; only when none of them is
correct, k of them are replaced by correct solutions from a pool written by several teacher models
(pre-collected). Comprehension-based selection: of the pool's solutions the k the student "understands"
best are injected. The group's advantage is then taken over the mixed group (GRPO's normalization),
so the injected correct rows get Â > 0 and the failed on-policy rows Â < 0. The injected rows are
off-policy (the teacher's probabilities are unknown) and trained with LUFFY's policy shaping
(Yan et al. 2025, "Learning to Reason under Off-Policy Guidance", arXiv 2504.14945), which AMPO builds on:

    on-policy tokens:  the run's clipped objective, min(r_t Â, clip(r_t, 1−ε_low, 1+ε_high) Â), r_t = π_θ/π_old
    injected tokens:   −f(π_θ(o_t | q, o_<t)) · Â,   f(p) = p / (p + γ),   γ = 0.1, no clipping

(LUFFY takes the off-policy ratio π_θ/π_teacher with π_teacher = 1, then shapes it by f, whose
gradient γ/(p+γ)² ∇p lifts the low-probability tokens of the teacher's path.)

What this library does (trainer/ampo_step.py, trainer/step.py):
- the pool is a dataset column (``algorithm.ampo.solutions_column``): a list of solution texts per row
  (one per teacher) or one text. Only the candidates the run's own correctness check accepts (full
  credit on the correctness reward, or on the total reward where none says right/wrong) are eligible;
- selection score (``algorithm.ampo.selection=mean_logprob``): the student's mean token log-probability
  of the candidate after the prompt, (1/|o|) Σ_t log π_θ(o_t | q, o_<t), one no-gradient chunked forward;
  the top ``num_replace`` are injected (ties: column order). ``selection=order`` skips the forward and
  takes the column's first correct candidates (an ablation, as the paper's random choice);
- the injected rows replace the group's last rows (the group is all wrong, so which ones is immaterial),
  keep their real reward (with DAPO's overlong penalty when on), end with the policy's own stop token
  (the chat template's end-of-turn), and enter the advantage estimator as any sample of the group;
  ``num_replace`` must be < ``rollout.n`` (a group of teacher rows only is all correct: Â = 0 on each);
- refused with it: SRPO (it would take a teacher row for the failed rows' correct sibling and zero
  their advantages), KDRL's mask=group (no group is all wrong after the injection), task.curriculum
  (its |Â| per source would count the injected groups), EAD's temperature schedule (no sampler
  log-probs for the teacher rows), and those check_ampo/check_run name below. The loop's accuracy and
  reward metrics are taken after the injection; ``ampo/pre_accuracy`` is the policy's own.

What is assumed (the method section could not be read here; the abstract, the model card and the
authors' released launch script could: ``num_off_policy_targets=2``, ``off_policy_reshape=p_div_p_0.1``,
``injection_strategy=adaptive``, ``target_selection_strategy=best_k``):
- the comprehension score: the authors' code ranks candidates with an RLPR-style probability reward
  (the student's mean per-token probability of the reference answer given the teacher's reasoning);
  how that answer is spliced into the path could not be confirmed, so the default here is the student's
  mean token log-probability of the whole candidate (the brief's score), a likelihood of the same path;
- k = 2 (``num_replace``) as the launch script; γ = 0.1 (``shaping_gamma``) as ``p_div_p_0.1``;
- the shaped term is aggregated with the run's ``loss_agg_mode`` and batch normalizers, the injected
  rows counted as rows of the batch (the authors' ``off_policy_loss_impl=seq`` was not read);
- an injected solution longer than ``rollout.max_new_tokens`` is cut there (then marked truncated).
"""

from __future__ import annotations

import math

import torch

# shaped_prob / off_policy_loss_mat are re-exported here: AMPO's tests and callers import them from this module.
from anabranch.algorithms.off_policy_split import off_policy_loss_mat, shaped_prob, split_objective  # noqa: F401

# Objectives whose per-row loss can leave the injected rows out (their mask), beside the shaped term.
AMPO_LOSSES = ("ppo_clip", "cispo", "gspo")
SELECTIONS = ("mean_logprob", "order")


def candidate_texts(row: dict, column: str) -> list[str]:
    """The teachers' solutions of ``row``: ``row[column]`` as a list of texts (or one text); empty ones dropped."""
    value = row.get(column)
    values = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    return [v for v in values if isinstance(v, str) and v.strip()]


def mean_log_prob(log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] (1/|o|) Σ_t log π(o_t) over each row's masked tokens (0 for a row without any)."""
    mask = mask.to(log_prob.dtype)
    return (log_prob * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def select_top(scores: list[float], k: int) -> list[int]:
    """Indices of the ``k`` candidates with the highest score, best first (ties: lower index first). The
    candidates are the correct ones already (trainer/ampo_step.py drops the others before scoring)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def ampo_objective(objective, log_prob, old_log_prob, advantage, mask, ctx, injected: torch.Tensor,
                   gamma: float, agg):
    """The micro-batch's loss: the run's ``objective`` on the on-policy rows (the injected rows masked
    out) plus agg(−f(π_θ)·Â) on the injected rows (``injected``: [b] bool), algorithms/off_policy_split.py's
    split shared with SCOPE; its metrics with ``ampo/shaped_prob`` (mean f over the injected tokens of this
    micro-batch, 0 without any; the update averages it over micro-batches by token share, so it is diluted
    by rows without any)."""
    rows = injected.to(mask.device).bool()[:, None].expand(mask.shape)
    loss, metrics, shaped = split_objective(objective, log_prob, old_log_prob, advantage, mask, ctx, rows, gamma, agg)
    # The key on every micro-batch of every rank (DDP's metric all-reduce needs the same keys everywhere).
    return loss, {**metrics, "ampo/shaped_prob": shaped}


def check_ampo(cfg) -> str | None:
    """The first problem with ``cfg.ampo`` (``cfg``: an AlgorithmConfig), alone or with the rest of the
    algorithm config, or None. Its knobs set while it is off are refused too (they would do nothing)."""
    a, num = cfg.ampo, (int, float)
    checks = [
        (isinstance(a.enabled, bool), "enabled", "must be true or false"),
        (isinstance(a.solutions_column, str) and bool(a.solutions_column.strip()), "solutions_column",
         "must name the dataset column holding the teachers' solutions (a list of texts per row)"),
        (isinstance(a.num_replace, int) and not isinstance(a.num_replace, bool) and a.num_replace >= 1,
         "num_replace", "must be an integer >= 1 (on-policy samples of an all-fail group replaced)"),
        (a.selection in SELECTIONS, "selection", f"must be one of {', '.join(SELECTIONS)}"),
        (isinstance(a.shaping_gamma, num) and not isinstance(a.shaping_gamma, bool)
         and math.isfinite(a.shaping_gamma) and a.shaping_gamma > 0, "shaping_gamma",
         "must be a finite number > 0 (γ of the policy shaping f(p) = p / (p + γ))"),
    ]
    for ok, key, why in checks:
        if not ok:
            return f"algorithm.ampo.{key} {why} (got {getattr(a, key)!r})"
    if not a.enabled:
        return inactive_knob(a)
    if cfg.loss not in AMPO_LOSSES:
        return (f"algorithm.ampo.enabled: the injected teacher rows leave the ratio objective for their own shaped "
                f"term, which is implemented for loss {', '.join(AMPO_LOSSES)}, not loss={cfg.loss!r}; set "
                "algorithm.ampo.enabled=false or another algorithm.loss")
    if cfg.advantage == "mssr":
        return ("algorithm.ampo.enabled with algorithm.advantage='mssr': MSSR's per-prompt success tracker would count "
                "the teachers' solutions as the prompt's own; use a group estimator (grpo, rloo, ...) or set "
                "algorithm.ampo.enabled=false")
    if cfg.dynamic_sampling:
        return ("algorithm.ampo.enabled with algorithm.dynamic_sampling: dynamic sampling drops the groups whose "
                "samples are all wrong before AMPO sees them, the only ones it guides; set "
                "algorithm.dynamic_sampling=false or algorithm.ampo.enabled=false")
    if cfg.srpo_coef > 0:
        return ("algorithm.ampo.enabled with algorithm.srpo_coef > 0: SRPO would take an injected teacher solution as "
                "the failed rows' correct sibling and zero those rows' advantages, the negative side AMPO's mixed "
                "group trains; set algorithm.srpo_coef=0 or algorithm.ampo.enabled=false")
    if cfg.kdrl.teacher and cfg.kdrl.mask == "group":
        return ("algorithm.ampo.enabled with algorithm.kdrl.mask=group: after the injection no group is all wrong, so "
                "KDRL's teacher KL would be switched off on exactly the prompts AMPO guides; use "
                "algorithm.kdrl.mask=response or none, or set algorithm.ampo.enabled=false")
    for other, on in (("hpt", cfg.hpt.enabled), ("guide", cfg.guide.enabled), ("scaffold", cfg.scaffold.enabled),
                      ("rl_plus", cfg.rl_plus.enabled)):
        if on:
            return (f"algorithm.ampo.enabled with algorithm.{other}.enabled: both act on the prompts the policy fails "
                    "(or add off-policy demonstrations to them); turn one of them off")
    return None


def inactive_knob(a) -> str | None:
    """The refusal of an ``algorithm.ampo`` knob set while AMPO is off (it would do nothing), or None. Run at
    config load (config_loading._refuse_inactive) and again at resolution, for configs built in code."""
    from anabranch.config_algorithm_options import AMPOConfig

    if a.enabled:
        return None
    default = AMPOConfig()
    for key in ("solutions_column", "num_replace", "selection", "shaping_gamma"):
        if getattr(a, key) != getattr(default, key):
            return (f"config key 'algorithm.ampo.{key}' has no effect unless algorithm.ampo.enabled=true "
                    f"(got {getattr(a, key)!r}); set algorithm.ampo.enabled=true or leave it at its default")
    return None


def run_problem(cfg) -> str | None:
    """The first whole-config combination AMPO cannot take (``cfg``: the whole Config, AMPO on), or None.
    Checked at config load (:func:`check_run`) and again by trainer/ampo_step.py's AMPO.create."""
    a, why = cfg.algorithm.ampo, None
    if isinstance(a.num_replace, int) and a.num_replace >= cfg.rollout.n:
        # A guided group of teacher solutions only is all correct: its advantages are all 0.
        return (f"algorithm.ampo.num_replace={a.num_replace} must be less than rollout.n={cfg.rollout.n}: a guided "
                "group of teacher solutions only is all correct, so its advantages are all 0 and nothing is learned; "
                "lower algorithm.ampo.num_replace or raise rollout.n")
    if cfg.rollout.backend != "hf":
        why = (f"rollout.backend={cfg.rollout.backend!r}: its samples carry the engine's log-probs, the teacher rows "
               "none, and AMPO is implemented and tested with the hf backend only; set rollout.backend=hf")
    elif cfg.rollout.tools:
        why = "rollout.tools: a teacher's solution text has no tool turns to mask; leave rollout.tools empty"
    elif cfg.rollout.retry_turns >= 2:
        why = "rollout.retry_turns: a teacher's solution is single-turn; set rollout.retry_turns=0"
    elif cfg.task.pairing:
        why = "task.pairing: prompt pairing trains fixed (q+, q−) groups of their own samples; set task.pairing=false"
    elif cfg.rollout.temperature_schedule != "constant":
        why = (f"rollout.temperature_schedule={cfg.rollout.temperature_schedule!r}: the teacher rows have no sampler "
               "log-probs at each position's scheduled temperature; set rollout.temperature_schedule=constant")
    elif cfg.task.curriculum != "none":
        why = (f"task.curriculum={cfg.task.curriculum!r}: the curriculum reads each source's mean |advantage|, which "
               "the teacher rows make non-zero on exactly the prompts the policy fails; set task.curriculum=none")
    if why is None:
        return None
    return f"algorithm.ampo.enabled cannot be used with {why}, or set algorithm.ampo.enabled=false"


def check_run(cfg) -> None:
    """At config load (config_loading.validate; ``cfg`` loaded, its recipe applied): AMPO's key checks
    (resolve_algorithm repeats them for configs built in code) and :func:`run_problem`, before any model loads."""
    from anabranch.config import ConfigError

    if cfg.algorithm.ampo.enabled and (error := check_ampo(cfg.algorithm) or run_problem(cfg)):
        raise ConfigError(error)
