"""ROVER: random policy valuation — fit the Q-function of the uniform policy, act by its softmax.

Haoran He, Yuxiao Ye, Qingpeng Cai, Chen Hu, Binxing Jiao, Daxin Jiang, Ling Pan 2025, "Random Policy
Valuation is Enough for LLM Reasoning with Verifiable Rewards" (arXiv 2509.24981). In a deterministic,
tree-structured MDP with binary terminal rewards the greedy policy w.r.t. the Q-function of the
*uniformly random* policy π_u is optimal (their Theorem 3.1), so no policy-iteration loop is needed:
evaluate Q^{π_u} and sample from softmax(Q/ρ). Its Bellman equation (γ = 1, deterministic s' = s∘a):

    Q^{π_u}(s, a) = r(s, a) + (1/|V|) · Σ_{a'∈V} Q^{π_u}(s', a')        (mean over the whole vocabulary)

The practical LLM algorithm, per response token t (state s_t = prompt + y_<t, action a_t = y_t):

    Q(s_t, a_t)  = ρ · (log π_θ(a_t|s_t) − log π_old(a_t|s_t))                     (no value network)
    Q̄(s)        = (1/|V|) Σ_v Q(s, v) = ρ · (mean_v log π_θ(v|s) − mean_v log π_old(v|s))
    y_t          = r̃ + Q̄(s_{t+1}) · m_{t+1}     (y_{T−1} = r̃: the last token's target is the reward)
    r̃           = r − mean_group(r)             (group-centered reward, broadcast to every token)
    L            = agg_t( (Q(s_t, a_t) − sg(y_t))² )                                ``token-mean``

π_old is the policy that sampled the batch, ρ = ``algorithm.rover_rho`` (default 1). Since
softmax_a(Q(s, a)/ρ) ∝ π_old(a|s)·π_θ(a|s)/π_old(a|s) = π_θ(a|s), acting by the softmax of Q is
sampling from the policy itself: rollouts need no change.

The mean over the vocabulary needs no [V]-sized tensor beyond one chunk of logits: with z = W h / τ,
mean_v log π(v|s) = mean_v z_v − logsumexp_v z_v (a per-position scalar). π_old's comes from the
advantage pass's forward (``old_vocab_mean``, trainer/advantage_pass.py), π_θ's from the update's
hidden states (``vocab_mean``, trainer/step.py), both by :func:`vocab_mean_log_prob`.

On-policy (``ppo_epochs = 1``) π_θ = π_old in value, so Q = 0 and Q̄ = 0: the target is r̃ and the
gradient is −2ρ·r̃·∇log π_θ(a_t|s_t), a REINFORCE step with a group-mean baseline; nothing beyond the
sampled-token log-probs is computed. The next-state term only acts from the second pass over a batch
(``ppo_epochs > 1``; the authors get the same by taking several mini-batch steps per batch), where
the vocabulary means of both policies are computed (needs a plain linear LM head: not under FSDP).

What the sources fix, and what is assumed. The paper's method section could not be read here (only
its abstract, Theorem 3.1 and third-party summaries: "mean-centered rewards ... broadcast to every
token", Q "parameterized intrinsically" by the LLM). The formulas above follow the authors' released
code (github.com/yuxiaooye/ROVER, ``Math/verl/workers/actor/dp_actor.py`` and ``core_algos.py``,
read, not copied): Q = ρ(log π_θ − log π_old); the vocabulary mean over the full vocabulary of the
temperature-scaled logits (``mean z − logsumexp z``); the next-state term zeroed where m_{t+1} = 0
and in the last column; the target detached; the masked token-mean of the squared error; ρ
(``rover_t``) defaulting to 1. Not implemented: their optional clipping of ρ·log π_θ/π_old
(``use_rover_clip``, off by default), ``next_q_scale_factor`` (1 by default) and a response-level
loss variant. Assumed: r̃ is the group-mean-centered reward (the summaries' description); the
authors' Math training script passes GRPO's std-normalized advantage instead — set
``algorithm.norm_adv_by_std=true`` to follow it (the recipe sets false).
"""

from __future__ import annotations

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.registries import OBJECTIVES, RECIPES
from anabranch.config import AlgorithmConfig


def rover_needs(cfg: AlgorithmConfig) -> tuple[str, ...]:
    """ROVER's inputs: nothing beyond the log-probs on-policy; with ``ppo_epochs > 1`` the per-position
    vocabulary means of π_old (advantage pass) and π_θ (update, from the hidden states)."""
    # algorithm.rover_rho is range-checked with the other keys (resolve.check_ranges).
    if cfg.ppo_epochs > 1:
        return ("old_log_prob", "old_vocab_mean", "vocab_mean", "hidden")
    return ()


@torch.no_grad()
def vocab_mean_log_prob(hidden: torch.Tensor, head: torch.nn.Linear, temperature: float,
                        chunk_rows: int = 4) -> torch.Tensor:
    """mean_v log π(v|s) = mean_v z_v − logsumexp_v z_v, z = head(h)/τ, for hidden states [B, R, H]
    (those that predict the response tokens); ``chunk_rows`` rows of vocabulary logits at a time."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    out = []
    for start in range(0, hidden.shape[0], chunk_rows):
        z = head(hidden[start:start + chunk_rows]).float() * inv_temp
        out.append(z.mean(-1) - torch.logsumexp(z, -1))
    return torch.cat(out)


def response_vocab_mean(model, hidden: torch.Tensor, prompt_width: int, width: int,
                        temperature: float) -> torch.Tensor:
    """[B, R] mean_v log π(v|s_t) for each response position t, from the full-width last hidden states
    [B, P+R, H] of ``forward_micro_batch(..., hidden=True)`` (position P−1+t predicts token t)."""
    from anabranch.models.chunked_logprobs import supports_chunked_head

    model = getattr(model, "module", model)  # DDP's wrapper
    if not supports_chunked_head(model):
        raise RuntimeError("loss=rover with ppo_epochs > 1 needs the LM head as a plain linear layer on the last "
                           "hidden states (not under FSDP, nor with logit scaling or soft-capping)")
    h = hidden.detach()[:, prompt_width - 1:prompt_width - 1 + width]
    return vocab_mean_log_prob(h, model.get_output_embeddings(), temperature)


def next_state_q(vocab_mean: torch.Tensor, old_vocab_mean: torch.Tensor, mask: torch.Tensor,
                 rho: float) -> torch.Tensor:
    """[B, T] Q̄(s_{t+1}) · m_{t+1}, 0 in the last column (the response ends there)."""
    q_bar = rho * (vocab_mean - old_vocab_mean) * mask
    return torch.cat([q_bar[:, 1:], torch.zeros_like(q_bar[:, :1])], dim=1)


@OBJECTIVES.register("rover", needs=rover_needs, advantage_is_reward=True)
def rover_loss(log_prob, old_log_prob, advantages, response_mask, ctx):
    rho = ctx.cfg.rover_rho
    m = response_mask.to(log_prob.dtype)
    q = rho * (log_prob - old_log_prob.detach())
    cur, old = ctx.extras.get("vocab_mean"), ctx.extras.get("old_vocab_mean")
    if cur is not None and old is not None:
        next_q = next_state_q(cur.to(m.dtype), old.to(m.dtype), m, rho)
    elif ctx.cfg.ppo_epochs > 1:
        raise RuntimeError("loss=rover with ppo_epochs > 1 needs the vocabulary means of π_θ and π_old "
                           "(ctx.extras 'vocab_mean' and 'old_vocab_mean') but they were not computed")
    else:  # one pass: π_θ = π_old, so Q̄(s_{t+1}) = 0 exactly
        next_q = torch.zeros_like(m)
    target = (advantages + next_q).detach()  # the recipe's advantage is r̃ on every response token
    loss = ctx.aggregate((q - target) ** 2, m)
    with torch.no_grad():
        metrics = {
            "rover/q_mean": masked_mean(q.detach(), m).item(),
            "rover/next_q_mean": masked_mean(next_q, m).item(),
            "rover/next_q_absmean": masked_mean(next_q.abs(), m).item(),
            "rover/target_mean": masked_mean(target, m).item(),
            "rover/td_error": masked_mean((q.detach() - target) ** 2, m).item(),
        }
    return loss, metrics


# r̃ = r − group mean (the paper's centering; GRPO without the std), squared error averaged over tokens.
RECIPES.register("rover")({"advantage": "grpo", "loss": "rover", "norm_adv_by_std": False,
                           "loss_agg_mode": "token-mean"})
