"""Per-position sampling temperature for training rollouts (``rollout.temperature_schedule``).

``constant`` (the default) samples every token at ``rollout.temperature``. ``ead`` is Exploratory
Annealed Decoding from Yang, Gui, Yang, Veitch, Zhang & Zhao (2025), "Let it Calm: Exploratory
Annealed Decoding for Verifiable Reinforcement Learning" (arXiv 2510.05251): explore at the start
of a response, exploit at its end. The response token at position t (0 = the first generated token)
is drawn at

    τ_t = 1                                   for t < c          (the first tokens are left alone)
    τ_t = max(1 + τ_max − exp(t / d_s), τ_min) otherwise
    d_s = min(d_0 + g·s, d_max)                (s: the training step; the paper's g = 5, d_max = 40000)

so τ starts at τ_max and falls to τ_min once exp(t/d_s) ≥ 1 + τ_max − τ_min. The decay d_s grows
with the training step because responses lengthen during RL training (the paper's "global-step-aware
decay"). The samples then come from a behaviour policy μ_t = softmax(z_t / τ_t), not from the trained
π_θ = softmax(z_t); the paper corrects this off-policyness with truncated importance sampling
(min(π_θ_old/μ, C), :mod:`anabranch.rollout.importance`, ``algorithm.tis_cap``). So the backend records
log μ_t(y_t) of the sampled tokens as ``Rollout.sample_log_probs``: the trainer's mismatch metrics and
TIS see the true behaviour policy.

Where the values come from. Formula, c, τ_max = 1.2 and τ_min = 0.1 (the paper's Figure, and the
authors' run script: exploration 1.2, stability 0.1, warm-up 10 tokens), g = 5 and d_max = 40000: the
paper / its README. d_0 is not stated in the text found; the authors' code divides t by 20·d with a
configured d = 25 at step 0, i.e. an effective d_0 = 500 (τ reaches τ_min after 500·ln 2.1 ≈ 371
tokens), which is the default here. Their code also grows the effective d by 20·5 = 100 per step
where the paper's formula says 5; the paper's g = 5 is the default (set ``rollout.ead_decay_growth``
to 100 to follow the code). The TIS cap is not given in the text found (the authors' config leaves
it off by default), so ``algorithm.tis_cap`` stays the user's choice; EAD without it warns.

Positions are response token indices: in multi-turn rollouts with tools the tool outputs inside the
response count as positions too (τ keeps cooling across turns). The step s is the number of
training steps done before the rollout (one ``policy_update`` each, whatever its ppo_epochs): the
backend counts its weight syncs (one per training step), and the training loop sets it at every step, so a resumed run continues the schedule.
"""

from __future__ import annotations

import torch

def ead_decay(d0: float, growth: float, d_max: float, step: int) -> float:
    """d_s = min(d_0 + g·s, d_max)."""
    return min(d0 + growth * step, d_max)


def ead_temperatures(positions: torch.Tensor, step: int, tau_max: float, tau_min: float, d0: float,
                     growth: float, d_max: float, warmup: int) -> torch.Tensor:
    """τ_t at each response position ``positions`` (any shape, integers >= 0), float32."""
    d = ead_decay(d0, growth, d_max, step)
    t = positions.to(torch.float64)
    # exp(t/d) overflows to inf for huge t/d: the clamp still gives τ_min.
    tau = (1.0 + tau_max - torch.exp(t / d)).clamp(min=tau_min)
    return torch.where(positions < warmup, torch.ones_like(tau), tau).to(torch.float32)


class EADSchedule:
    """The EAD schedule of a rollout config (``rollout.ead_*``)."""

    def __init__(self, cfg):
        self.tau_max, self.tau_min = cfg.ead_tau_max, cfg.ead_tau_min
        self.d0, self.growth, self.d_max = cfg.ead_decay, cfg.ead_decay_growth, cfg.ead_decay_max
        self.warmup = cfg.ead_warmup_tokens

    def temperatures(self, positions: torch.Tensor, step: int) -> torch.Tensor:
        return ead_temperatures(positions, step, self.tau_max, self.tau_min, self.d0, self.growth,
                                self.d_max, self.warmup)


def make_schedule(cfg) -> EADSchedule | None:
    """The schedule of ``rollout.temperature_schedule``; None for ``constant`` (no per-token work)."""
    return EADSchedule(cfg) if cfg.temperature_schedule == "ead" else None


class AnnealedTemperature:
    """A ``generate`` logits processor: divides row i's scores by τ at its response position and keeps
    log μ(y) of each sampled token. ``generate`` calls it once per new token, after its own processors
    (the min-new-tokens EOS mask) and before the sampling warpers, which the config keeps neutral with
    EAD (temperature 1, no top-k / top-p), so softmax of what it returns is what is sampled from.

    ``offsets[i]``: response tokens row i already has (multi-turn continuations; 0 for a fresh
    response). ``prompt_width``: the width of the ids ``generate`` started from."""

    def __init__(self, schedule: EADSchedule, step: int, prompt_width: int, offsets: torch.Tensor):
        self.schedule, self.step, self.width = schedule, step, prompt_width
        self.offsets = offsets.cpu()
        self._last: torch.Tensor | None = None  # [B, V] log μ of the latest step
        self._taken: list[torch.Tensor] = []     # [B] log μ(y_k) of each step k already sampled

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = input_ids.shape[1] - self.width  # tokens generated so far = index of the one about to be drawn
        if self._last is not None:  # the previous step's token is now known: keep its log-prob only
            self._taken.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        # τ on the CPU (float64: MPS has none), one [B] copy to the device per token.
        tau = self.schedule.temperatures(self.offsets + k, self.step).to(scores.device)
        scores = scores / tau.to(scores.dtype)[:, None]
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def log_probs(self, new_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] log μ of ``new_ids`` (the L generated columns), 0 where not finite (the pad after a
        finished row may have had probability 0)."""
        width = new_ids.shape[1]
        taken = list(self._taken[:width])
        if len(taken) < width and self._last is not None:  # the last step's token was never fed back
            taken.append(self._last.gather(1, new_ids[:, len(taken):len(taken) + 1].to(self._last.device)).squeeze(1))
        if not taken:
            return torch.zeros(new_ids.shape, dtype=torch.float32)
        lp = torch.stack(taken, dim=1).cpu()
        return torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))


def ead_tis_warning(cfg) -> str | None:
    """The paper pairs EAD with truncated importance sampling; without it the tempered samples are
    trained on as if drawn from π_θ. Returns the warning's text (None: nothing to say)."""
    if cfg.rollout.temperature_schedule != "ead" or cfg.algorithm.tis_cap > 0:
        return None
    return ("rollout.temperature_schedule=ead samples at τ_t != 1, off the trained policy; the EAD paper "
            "corrects this with truncated importance sampling, off here (algorithm.tis_cap=0): the mismatch "
            "is logged (mismatch/kl) but not corrected; set algorithm.tis_cap (e.g. 2) to correct it")
