"""SAFE's entropy-gated KL with a PID-controlled threshold (and its soft-min of two values).

Paper: Dipan Maity, "SAFE: Stable Alignment Finetuning with Entropy-Aware Predictive Control for RLHF"
(2026, arXiv:2602.04651; code: github.com/ryyzn9/SAFE, ``notebooks/mainD.py``). SAFE is PPO with (1) a
double soft-min critic, (2) an entropy-gated penalty on the KL to the reference, L_EPC = g_t·L_base, and
(3) a threshold on that KL moved by a PID controller on the reward's velocity, τ_t = (τ_base + PID(r_t))·φ_t.
This module is (2) and (3), an extra loss term beside any objective of the GRPO family, and the soft-min
of (1) as a function (:func:`soft_min`); (1) itself is an option of the PPO critic, ``algorithm.vf_double_critic``
(algorithms/double_critic.py: a second value head, GAE on the soft-min, each head trained on the returns):

* measured once per step, from each response's first forward of the step (global under DDP):
  KL_t = Σ m·(log π_θ − log π_ref) / Σ m (k1, the token mean), H_t = the mean over responses of each
  response's mean token entropy, r_t = the batch's mean reward;
* KL tracker: K̄_t = d·K̄_{t−1} + (1 − d)·KL_t, d = ``kl_ema`` (0.9), K̄_0 = 0;
* PID on the reward's velocity: r̄_t = a·r̄_{t−1} + (1 − a)·r_t (a = ``reward_ema``, 0.95; the first
  step sets r̄ = r_1 and outputs 0), e_t = (r̄_t − r̄_{t−1}) − v* (v* = ``target_velocity``, 0.001),
  I_t = clip(I_{t−1} + e_t, −I_max, I_max) (anti-windup, I_max = ``integral_limit``, 1),
  PID_t = k_p·e_t + k_i·I_t + k_d·(e_t − e_{t−1})  (k_p, k_i, k_d = 0.3, 0.01, 0.05; e_0 = 0);
* threshold: τ_t = clip(τ_base + PID_t, τ_min, τ_max)  (0.3, 0.1, 0.6);
* entropy gate: g_t = max(0.5, H_floor / (H_t + 0.1)), H_floor = ``entropy_floor`` (2.0): low entropy
  (collapse) amplifies the penalty, high entropy (exploration) relaxes it to half;
* coefficient: β_t = min(β_max, 2·c·[K̄_t − τ_t]₊), c = ``coef`` (0.1): the slope of the released
  penalty c·(K̄ − τ)² at the measured KL, 0 while the KL is under the threshold;
* term, on the next step's micro-batches: L += β_t · g_t · agg(KL_est(log π_θ, log π_ref)), KL_est the
  library's estimator ``estimator`` (k3; algorithms/kl.py) per trained token, ``agg`` the objective's
  own aggregation. β_t and g_t are numbers (no gradient); the KL term keeps its per-token gradient.

What is confirmed, from the authors' released code (``mainD.py``: ``PIDController``,
``EntropyAwarePredictiveController.compute_penalty``, ``DoubleCritic.soft_min``) and the paper's
abstract and summary formulas: every constant above (EMA rates 0.9 and 0.95, target velocity 0.001, the
integral clamp ±1, the gains, τ_base 0.3 clipped to [0.1, 0.6], the gate max(0.5, 2/(H + 0.1)), the
quadratic penalty 0.1·(K̄ − τ)² when K̄ > τ), the k1 token-mean KL it tracks, the soft-min with α = 0.3.
Differences, on purpose (the method text beyond the abstract was not available to us):

* **the released penalty has no gradient**: it is computed from ``kl.item()`` and logged entropies, a
  Python float added to the loss, so as released it changes only the logged loss, never the policy (the
  same situation as EPO's constant, algorithms/epo.py). Here the gate and the coefficient come from
  detached batch statistics and multiply a per-token KL that keeps its gradient; β_t = 2c·[K̄ − τ]₊ makes
  the term's gradient that of the released quadratic had its KL been differentiable (up to the EMA's
  1 − d on the current step and the estimator), clamped to [0, β_max];
* one update per step, one step late: the released controller updates on every PPO epoch with that
  epoch's KL; here the statistics of step t (its first forward, this step's weights) update the state
  once in :meth:`SafePass.finish`, and step t + 1's term uses them (step 1 has no term: K̄_0 = 0);
* the phase multiplier φ_t (1.5 warm-up for 50 steps, 1.2 climbing, 0.8 plateau, 1.0 converged, from a
  50/100-step reward history and an absolute reward level 0.7 of their reward model) is left out: φ = 1;
* the released "max preview KL" step scaling (present in its config, unused in its loop) is left out;
* the double soft-min critic (two value heads, V_soft = −α·log(½e^{−V1/α} + ½e^{−V2/α}) as GAE's value)
  lives in algorithms/double_critic.py with its own differences from the released code;
* the controller's state is global under data parallelism (its sums all-reduced) and saved in checkpoints.
"""

from __future__ import annotations

import math

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.kl import ESTIMATORS, kl_penalty
from anabranch.range_checks import first_failed, is_number

GATE_MIN, GATE_EPS = 0.5, 0.1  # the released gate max(0.5, H_floor / (H + 0.1))


def soft_min(v1: torch.Tensor, v2: torch.Tensor, alpha: float = 0.3) -> torch.Tensor:
    """V_soft = −α·log(½e^{−V1/α} + ½e^{−V2/α}): between min(V1, V2) and their mean, → min as α → 0."""
    s = torch.stack([-v1 / alpha, -v2 / alpha], -1)
    return -alpha * (torch.logsumexp(s, -1) - math.log(2.0))


def entropy_gate(entropy: float, floor: float) -> float:
    """g = max(0.5, H_floor / (H + 0.1))."""
    return max(GATE_MIN, floor / (entropy + GATE_EPS))


class SafeController:
    """The KL tracker, the PID's state and the step's coefficient and gate, saved in checkpoints."""

    STATE = ("kl_ema_value", "reward_ema_value", "integral", "prev_error", "threshold", "gate", "beta", "steps")

    def __init__(self, cfg):
        self.cfg = cfg  # an algorithm.safe section (SAFEConfig)
        self.kl_ema_value = 0.0             # K̄ (the released tracker starts at 0)
        self.reward_ema_value: float | None = None  # r̄ (None before the first step)
        self.integral, self.prev_error = 0.0, 0.0
        self.threshold = float(cfg.threshold)
        self.gate, self.beta = 1.0, 0.0     # the next step's g and β (no term before any measurement)
        self.steps = 0

    def pid(self, reward: float) -> float:
        """PID_t on the reward EMA's velocity (0 on the first call, which only sets the EMA)."""
        c = self.cfg
        if self.reward_ema_value is None:
            self.reward_ema_value = reward
            return 0.0
        old = self.reward_ema_value
        self.reward_ema_value = c.reward_ema * old + (1.0 - c.reward_ema) * reward
        error = (self.reward_ema_value - old) - c.target_velocity
        self.integral = max(-c.integral_limit, min(c.integral_limit, self.integral + error))  # anti-windup
        out = c.kp * error + c.ki * self.integral + c.kd * (error - self.prev_error)
        self.prev_error = error
        return out

    def update(self, kl: float | None, entropy: float | None, reward: float | None) -> dict:
        """Fold one step's batch statistics (None: not measured, that signal's state is kept) into the state."""
        c = self.cfg
        self.steps += 1
        if kl is not None:
            self.kl_ema_value = c.kl_ema * self.kl_ema_value + (1.0 - c.kl_ema) * kl
        pid = self.pid(reward) if reward is not None else 0.0
        self.threshold = min(c.threshold_max, max(c.threshold_min, c.threshold + pid))
        if entropy is not None:
            self.gate = entropy_gate(entropy, c.entropy_floor)
        self.beta = min(c.beta_max, 2.0 * c.coef * max(0.0, self.kl_ema_value - self.threshold))
        return {"safe/pid": pid}

    def begin(self, rewards: torch.Tensor) -> "SafePass":
        return SafePass(self, rewards)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self.STATE:
            setattr(self, k, state[k])


class SafePass:
    """One update: β·g fixed at its start, the term of each micro-batch, and the step's statistics (from each
    row's first forward, also when an out-of-memory retry runs the epoch again) that :meth:`finish` folds in."""

    def __init__(self, state: SafeController, rewards: torch.Tensor):
        self.state, self.coef = state, state.beta * state.gate
        r = rewards.detach().double().reshape(-1).cpu()
        self.reward_sum, self.reward_count = float(r.sum()), float(r.numel())
        self.seen: dict[int, tuple[float, float, float]] = {}  # row -> (Σ m·k1, Σ m, the row's mean entropy)

    def loss(self, log_probs: torch.Tensor, ref_log_prob: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor,
             rows: torch.Tensor, agg) -> tuple[torch.Tensor, dict]:
        """``β·g·agg(KL_est)`` for a micro-batch (a zero without graph while β·g = 0) and its metrics."""
        m = mask.to(log_probs.dtype)
        with torch.no_grad():
            k1 = ((log_probs.detach() - ref_log_prob).double() * m).sum(-1)
            counts = m.double().sum(-1)
            ent_sum = (ent.detach().double() * m).sum(-1)
        for r, k, n, h in zip(rows.tolist(), k1.tolist(), counts.tolist(), ent_sum.tolist()):
            self.seen.setdefault(int(r), (k, n, h / n if n > 0 else 0.0))
        if self.coef == 0:
            return log_probs.new_zeros(()), {}
        kl = kl_penalty(log_probs, ref_log_prob, self.state.cfg.estimator)
        return self.coef * agg(kl, m), {"safe/kl_est": masked_mean(kl.detach(), m).item()}

    def finish(self, dist=None) -> dict:
        """The step's global statistics folded into the controller; its metrics."""
        vals = [v for v in self.seen.values() if v[1] > 0]
        sums = torch.tensor([sum(v[0] for v in vals), sum(v[1] for v in vals), sum(v[2] for v in vals),
                             float(len(vals)), self.reward_sum, self.reward_count], dtype=torch.float64)
        if dist is not None:
            sums = dist.all_reduce_sum(sums)
        kl = float(sums[0] / sums[1]) if sums[1] > 0 else None
        entropy = float(sums[2] / sums[3]) if sums[3] > 0 else None
        reward = float(sums[4] / sums[5]) if sums[5] > 0 else None
        out = {"safe/coef": self.coef, "safe/active": float(self.coef > 0)}
        out.update(self.state.update(kl, entropy, reward))
        out.update({"safe/kl_ema": self.state.kl_ema_value, "safe/threshold": self.state.threshold,
                    "safe/gate": self.state.gate, "safe/beta": self.state.beta})
        if kl is not None:
            out["safe/kl"] = kl
        if entropy is not None:
            out["safe/entropy"] = entropy
        return out


def build_safe(cfg) -> SafeController | None:
    """The stateful controller for ``algorithm.safe.enabled``, else None."""
    return SafeController(cfg.safe) if cfg.safe.enabled else None


def check_safe(cfg) -> str | None:
    """The first problem with the ``algorithm.safe`` keys of an AlgorithmConfig (its method on), as an error."""
    s = cfg.safe
    if not s.enabled:
        return None
    num = is_number
    checks = [
        (num(s.coef) and s.coef > 0, "coef", "must be a finite number > 0, c of the released penalty c·(K̄ − τ)²"),
        (num(s.beta_max) and s.beta_max > 0, "beta_max", "must be a finite number > 0, the ceiling on β"),
        (s.estimator in ESTIMATORS, "estimator", f"must be one of {', '.join(ESTIMATORS)}"),
        (num(s.threshold_min) and s.threshold_min >= 0, "threshold_min", "must be a finite number >= 0"),
        (num(s.threshold_max) and num(s.threshold_min) and s.threshold_max >= s.threshold_min, "threshold_max",
         f"must be a finite number >= algorithm.safe.threshold_min={s.threshold_min!r}"),
        (num(s.threshold) and num(s.threshold_min) and num(s.threshold_max)
         and s.threshold_min <= s.threshold <= s.threshold_max, "threshold",
         f"must lie in [threshold_min, threshold_max] = [{s.threshold_min!r}, {s.threshold_max!r}]"),
        *[(num(getattr(s, k)) and getattr(s, k) >= 0, k, "must be a finite number >= 0 (a PID gain)")
          for k in ("kp", "ki", "kd")],
        (num(s.integral_limit) and s.integral_limit > 0, "integral_limit",
         "must be a finite number > 0, the anti-windup clamp on the PID's integral"),
        (num(s.target_velocity), "target_velocity", "must be a finite number"),
        *[(num(getattr(s, k)) and 0 <= getattr(s, k) < 1, k, "must be in [0, 1), an EMA's decay")
          for k in ("reward_ema", "kl_ema")],
        (num(s.entropy_floor) and s.entropy_floor > 0, "entropy_floor", "must be a finite number > 0"),
    ]
    error = first_failed(checks, "algorithm.safe", s)
    if error is not None:
        return error
    if cfg.kl_coef > 0 and cfg.kl_in == "loss":
        return (f"algorithm.safe.enabled replaces the fixed KL term to the reference with its gated one, but "
                f"algorithm.kl_coef={cfg.kl_coef!r} with kl_in=loss adds a second: set algorithm.kl_coef=0 (or "
                "kl_in=reward, a KL penalty in the reward)")
    return None
