"""Online low-likelihood filter: train only on the prompts the *current* policy answers wrong greedily.

Nguyen, La, Nguyen, Chawla, Nguyen, Doan (2025), "The Reasoning Boundary Paradox: How Reinforcement
Learning Constrains Language Models" (arXiv 2510.02230), SELF as in the authors' released trainer
(``task.curation=greedy_wrong``; the π_0 pre-pass reading is ``task.curation=low_likelihood``,
trainer/curation.py). For every generation round's drawn prompts Q:

    greedy   y*(q) = argmax decode of π_θ(· | q)          one greedy completion per prompt, current weights
    score    r*(q) = the run's rewards on y*(q)           correct(q) = full credit on the reward that says
                                                          right/wrong, else on the total (``batch_correct``);
                                                          only that reward is run when there is one
    keep     Q' = {q ∈ Q : not correct(q)}                only Q' is sampled (rollout.n each) and trained on

What the released code does, and what is taken from it (read, not copied): its greedy pass is the
rollout worker's generation with sampling switched off (``do_sample=False``), so the same prompt and
response-length limits as the training samples; here ``backend.generate(prompts, 1, greedy=True)``
with ``rollout.max_new_tokens``. Its test is "summed reward != 1"; here the project's full-credit test
(the same one dynamic sampling and accuracy use). It does not refill: the batch shrinks to the wrong
prompts (padded to a multiple of the GPUs by repeating rows), so a step trains on |Q'| <= prompts_per_step
groups. A batch whose greedy answers are all right is skipped and the next batch drawn without counting
a step; here the same happens as a redraw of ``prompts_per_step`` fresh prompts. The redraws of a step
share one budget of ``algorithm.max_sample_batches − 1`` (assumed bound: the released loop has none, a
run whose policy solves everything greedily must still end): every draw a round asks for gets its greedy
pass, and a draw solved greedily is replaced only while the step's budget lasts; once it is spent, the
draw is trained on as is and ``curation/greedy_all_correct`` is 1 for that step (a logged step, not a
hang). With DAPO's dynamic sampling each of its rounds is filtered, so its rounds refill the batch.

Cost per step: at most ``max_sample_batches`` greedy passes (one completion per prompt, ``prompts_per_step``
prompts each) without dynamic sampling; with it, one per DAPO round plus the shared redraws, so at most
2·max_sample_batches − 1 (19 at the default 10). The greedy generation time is part of the step's
``time/generate_s`` (it is generation the step waits for, as Guide's hinted samples are) and is also
logged alone as ``time/greedy_s``.

Greedy completions are not training samples: the stateful rewards (OLR's visits, LASER-D's length
window) drop what the greedy scoring recorded (``discard_reward_observations``, as Guide does).
One process only: ranks would keep different numbers of prompts (refused by ``check_curation_config``
and ``Distributed.prepare``).

Metrics per step: ``curation/greedy_wrong_frac`` (wrong greedy answers / prompts decoded greedily),
``curation/kept_prompts`` (prompts sampled), ``curation/greedy_draws`` (greedy passes),
``curation/greedy_all_correct`` and ``time/greedy_s`` (the greedy generation's seconds).
"""

from __future__ import annotations

from anabranch.eval.accuracy import batch_correct, correctness_source
from anabranch.rewards.compose import discard_reward_observations


class _GreedyBackend:
    """The run's backend with every call turned into one greedy completion per prompt."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompts, n, **_):
        return self.inner.generate(prompts, 1, greedy=True)


class _GreedyComponents:
    """The run's components (model, rewards, rows, ...) with the greedy backend in place of its own."""

    def __init__(self, c):
        self._c, self.backend = c, _GreedyBackend(c.backend)

    def __getattr__(self, name):
        return getattr(self._c, name)


def greedy_correct(c, idx: list[int], cfg, step: int | None = None) -> tuple[list[float], float]:
    """(1.0 / 0.0 per prompt of ``idx``: is the current policy's greedy answer fully correct?, the greedy
    generation's seconds). Scored as training samples are (``generate_scored``), but only the verdict is
    read: with a reward that says right/wrong, that source alone is scored, so a PRM's forward, RLPR's
    policy forward or a judge among the other sources is not run for answers nobody trains on; without
    one, the full total (every source, overlong shaping) as before."""
    from anabranch.trainer.collect import generate_scored  # lazy: collect.py calls into this module

    src = correctness_source(c.rewards)
    batch = generate_scored(_GreedyComponents(c), idx, cfg, step, n=1, sources=None if src is None else [src])
    # A greedy answer is not a training sample: OLR / LASER-D must not learn from it.
    discard_reward_observations(c.rewards)
    return batch_correct(batch, c.rewards), batch.t_generate


class GreedyWrongSampler:
    """Wraps the run's sampler: ``next(k)`` draws k prompts and returns those answered wrong greedily."""

    greedy_filtered = True  # collect_batch: already filtered, do not wrap again

    def __init__(self, c, inner, cfg, step: int | None = None):
        self.c, self.inner, self.cfg, self.step = c, inner, cfg, step
        # One budget of redraws for the whole step, shared by DAPO's rounds (each round's first pass is free).
        self.redraws_left = cfg.algorithm.max_sample_batches - 1
        self.decoded = self.wrong = self.kept = self.draws = self.all_correct = 0
        self.seconds = 0.0

    def next(self, k: int) -> list[int]:
        while True:
            idx = self.inner.next(k)
            flags, seconds = greedy_correct(self.c, idx, self.cfg, self.step)
            keep = [i for i, ok in zip(idx, flags) if not ok]
            self.draws, self.decoded, self.wrong = self.draws + 1, self.decoded + len(idx), self.wrong + len(keep)
            self.seconds += seconds
            if keep:
                self.kept += len(keep)
                return keep
            if self.redraws_left <= 0:
                break
            self.redraws_left -= 1
        # Every draw solved greedily and the step's redraws spent: train on the last one as is (the step runs and logs).
        self.all_correct, self.kept = 1, self.kept + len(idx)
        return idx

    def metrics(self) -> dict:
        return {"curation/greedy_wrong_frac": self.wrong / max(self.decoded, 1),
                "curation/kept_prompts": float(self.kept), "curation/greedy_draws": float(self.draws),
                "curation/greedy_all_correct": float(self.all_correct), "time/greedy_s": self.seconds}


def collect_filtered(c, sampler, cfg, dist=None, group_filter=None, step: int | None = None):
    """``collect_batch`` on the greedy-wrong prompts of each round, with the filter's metrics."""
    from anabranch.trainer.collect import collect_batch

    filtered = GreedyWrongSampler(c, sampler, cfg, step)
    batch = collect_batch(c, filtered, cfg, dist, group_filter, step)
    batch.t_generate += filtered.seconds  # time/generate_s holds all of the step's generation, the greedy part too
    batch.metrics = {**batch.metrics, **filtered.metrics()}
    return batch
