"""RLPR's adaptive reward-standard-deviation filter, a group filter for dynamic sampling.

Paper: Yu, Ji, Wang, Yao, Wang, Cui, Yuan, Ding, Yao, Liu, Sun, Chua (2025), "RLPR: Extrapolating
RLVR to General Domains without Verifiers" (arXiv 2506.18254), its standard-deviation filtering.
Prompts whose rewards vary little across their n samples are either too easy or too hard for the
policy, and with RLPR's continuous probability reward "all equal" almost never happens exactly, so
instead of DAPO's all-equal test a group g is kept only when the (Bessel-corrected) standard
deviation of its n rewards reaches a threshold:

    σ_g = std(r_g,1 .. r_g,n)        keep g  ⇔  σ_g ≥ β_t,      β_t = std_filter_beta · m_{t−1}

and the threshold follows the rewards' spread with an exponential moving average of the mean group
std of each training step (every group generated in that step: every refill round, every rank,
before filtering; non-finite stds left out):

    s_t = mean_g σ_g,        m_t = d · m_{t−1} + (1 − d) · s_t      (d = std_filter_ema_decay)

Dropped groups are replaced by new prompts like DAPO's dynamic sampling (``trainer/collect.py``).

Only summaries of the paper's text could be consulted here (the rule above: prompts with a reward
std below β dropped, β following an EMA); the details were taken from the authors' released training
script and trainer (read in a public fork of github.com/OpenBMB/RLPR), and are assumptions where noted:

* d = 0.99 and std_filter_beta = 0.5 (their Qwen script; other scripts use 1.0); the std is the
  sample std (n − 1), as their GRPO advantage computes it; a group with a non-finite std is dropped.
* Warm-up: the first ``std_filter_warmup_steps`` steps (10; theirs filter from step 11) keep every
  group (threshold 0); m starts, at the end of the warm-up, as the plain mean of s_t over its last
  ``std_filter_init_steps`` steps (5; theirs average steps 6-10). Their bookkeeping of those
  statistics differs in detail (it is tied to other switches of their trainer); this is the rule
  it states, not a line-by-line port.
* The threshold of step t is fixed for all its refill rounds and m is updated after the step's
  batch is collected (their order: update at the start of the next step); refilled batches are not
  cached across steps as theirs are (a surplus of kept groups is discarded, as here for DAPO).
* Which reward σ_g is computed on follows ``algorithm.dynamic_sampling_metric`` (``reward``: the
  total reward, theirs; ``accuracy``: the right/wrong flags where a reward says right/wrong).
"""

from __future__ import annotations

import math

import torch


def group_stds(signal: torch.Tensor, group_index: torch.Tensor) -> dict[int, float]:
    """{group: sample std (n − 1) of its rewards}, NaN for a group of one (no spread to measure)."""
    out = {}
    for g in group_index.unique():
        r = signal[group_index == g].double()
        out[int(g)] = float(r.std()) if r.numel() > 1 else float("nan")
    return out


class StdFilter:
    """Keeps groups with σ_g ≥ β_t; ``end_step`` feeds it the step's summed σ and count (summed
    over ranks in a data-parallel run, so that every rank's β is the same)."""

    def __init__(self, beta: float = 0.5, decay: float = 0.99, warmup_steps: int = 10, init_steps: int = 5):
        self.beta, self.decay = float(beta), float(decay)
        self.warmup_steps, self.init_steps = int(warmup_steps), int(init_steps)
        self.steps = 0            # steps whose statistics were taken
        self.ema: float | None = None
        self.warmup_means: list[float] = []
        self.last_mean: float | None = None

    @property
    def threshold(self) -> float:
        """β_t for the coming step: 0 during the warm-up (every group with a finite std kept)."""
        if self.steps < self.warmup_steps or self.ema is None:
            return 0.0
        return self.beta * self.ema

    def keep(self, signal: torch.Tensor, group_index: torch.Tensor) -> tuple[list[int], float, int]:
        """(groups kept, in order; sum of the finite σ_g; how many) for one round."""
        beta = self.threshold
        kept, total, count = [], 0.0, 0
        for g, s in group_stds(signal, group_index).items():
            if math.isfinite(s):
                total, count = total + s, count + 1
                if s >= beta:
                    kept.append(g)
        return kept, total, count

    def end_step(self, std_sum: float, count: int) -> dict:
        """Fold in the step's mean σ (all groups generated in it; a step with none leaves m alone) and
        return the step's metrics, with the threshold it filtered with."""
        used = self.threshold
        self._fold(std_sum, count)
        return self.metrics(used)

    def _fold(self, std_sum: float, count: int) -> None:
        self.steps += 1
        mean = std_sum / count if count > 0 else None
        self.last_mean = mean
        if mean is None or not math.isfinite(mean):
            return
        if self.steps <= self.warmup_steps:
            if self.steps > self.warmup_steps - self.init_steps:
                self.warmup_means.append(mean)
            if self.steps == self.warmup_steps:
                self.ema = sum(self.warmup_means) / len(self.warmup_means)
        elif self.ema is None:  # no finite σ in the warm-up's last steps: start from this one
            self.ema = mean
        else:
            self.ema = self.decay * self.ema + (1.0 - self.decay) * mean

    def metrics(self, threshold: float) -> dict:
        """``threshold``: the β this step filtered with (``threshold`` is already the next step's)."""
        out = {"std_filter/threshold": threshold}
        if self.ema is not None:
            out["std_filter/ema"] = self.ema
        if self.last_mean is not None:
            out["std_filter/mean_group_std"] = self.last_mean
        return out

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"steps": self.steps, "ema": self.ema, "warmup_means": list(self.warmup_means),
                "last_mean": self.last_mean}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.ema = None if state["ema"] is None else float(state["ema"])
        self.warmup_means = [float(x) for x in state["warmup_means"]]
        self.last_mean = state.get("last_mean")


def build_std_filter(cfg) -> StdFilter | None:
    """The filter for ``algorithm.dynamic_sampling_filter=std`` (with dynamic sampling on), else None."""
    if not (cfg.dynamic_sampling and cfg.dynamic_sampling_filter == "std"):
        return None
    return StdFilter(cfg.std_filter_beta, cfg.std_filter_ema_decay, cfg.std_filter_warmup_steps,
                     cfg.std_filter_init_steps)


def check_std_filter(cfg) -> str | None:
    """The first problem with the std-filter keys of an AlgorithmConfig, as an error message."""
    if cfg.dynamic_sampling_filter not in ("all_equal", "std"):
        return f"algorithm.dynamic_sampling_filter must be 'all_equal' or 'std' (got {cfg.dynamic_sampling_filter!r})"
    if cfg.dynamic_sampling_filter == "std" and not cfg.dynamic_sampling:
        return ("algorithm.dynamic_sampling_filter=std needs algorithm.dynamic_sampling=true: RLPR's std filter drops "
                "groups and refills the batch through dynamic sampling")
    if not (0 < cfg.std_filter_beta < float("inf")):
        return f"algorithm.std_filter_beta must be positive and finite (got {cfg.std_filter_beta!r})"
    if not (0 <= cfg.std_filter_ema_decay < 1):
        return f"algorithm.std_filter_ema_decay must be in [0, 1) (got {cfg.std_filter_ema_decay!r})"
    if cfg.std_filter_warmup_steps < 1:
        return (f"algorithm.std_filter_warmup_steps must be >= 1: the threshold starts from the warm-up's mean group "
                f"std (got {cfg.std_filter_warmup_steps!r})")
    if not (1 <= cfg.std_filter_init_steps <= cfg.std_filter_warmup_steps):
        return (f"algorithm.std_filter_init_steps must be in [1, algorithm.std_filter_warmup_steps="
                f"{cfg.std_filter_warmup_steps}] (got {cfg.std_filter_init_steps!r})")
    return None
