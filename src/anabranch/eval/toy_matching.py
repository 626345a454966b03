"""An enumerable toy problem for checking what an objective converges to.

One prompt; the answer is a single token out of K; answer k earns reward r_k. The policy is a
tabular softmax π_θ(k) = softmax(θ)_k that starts at the prior π_ref. Each step samples
``groups`` groups of ``group_size`` answers, computes advantages and the loss with the
*registered* estimator and objective of ``algorithm.name`` (the same functions the trainer calls),
and takes an Adam step on θ and on any extra head (log Z). Because K is small, the final π_θ can
be compared exactly with the FlowRL target π_ref·exp(β·r)/Z.

The log Z head sees a fixed random "prompt embedding" (there is one prompt), so the same
:class:`~anabranch.models.log_z.LogZHead` as in real training is exercised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import torch

from anabranch.algorithms.aggregation import BatchScale, aggregate
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig
from anabranch.trainer.step import LossContext


@dataclass
class ToyResult:
    probs: torch.Tensor                   # final π_θ [K]
    history: list = field(default_factory=list)  # per-step metrics (with "probs")


def target_distribution(ref_probs, rewards, beta: float) -> torch.Tensor:
    """FlowRL's target p*(k) = π_ref(k)·exp(β·r_k) / Z."""
    ref = torch.as_tensor(ref_probs, dtype=torch.float64)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    return torch.softmax(ref.log() + beta * r, dim=0)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) = Σ p·log(p/q), with 0·log 0 = 0."""
    p, q = p.double(), q.double()
    keep = p > 0
    return max(0.0, float((p[keep] * (p[keep].log() - q[keep].log())).sum()))  # rounding can give -1e-17


def entropy(p: torch.Tensor) -> float:
    p = p.double()
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def train_tabular(algorithm: AlgorithmConfig, rewards, ref_probs, *, steps: int = 300, groups: int = 4,
                  group_size: int = 8, lr: float = 0.05, seed: int = 0, hidden_size: int = 16,
                  record_every: int = 0) -> ToyResult:
    """Train a tabular softmax policy on the toy problem with ``algorithm`` (any registered recipe)."""
    # The tensors are tiny: intra-op threads only add synchronization (measured 35x slower with 2
    # threads on a busy 2-core machine), so run single-threaded and restore the setting after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_tabular(algorithm, rewards, ref_probs, steps=steps, groups=groups, group_size=group_size,
                              lr=lr, seed=seed, hidden_size=hidden_size, record_every=record_every)
    finally:
        torch.set_num_threads(threads)


def _train_tabular(algorithm, rewards, ref_probs, *, steps, groups, group_size, lr, seed, hidden_size,
                   record_every) -> ToyResult:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    algo = resolve_algorithm(algorithm)
    rewards_t = torch.as_tensor(rewards, dtype=torch.float32)
    log_ref = torch.as_tensor(ref_probs, dtype=torch.float32).log()
    logits = log_ref.clone().requires_grad_()
    model_config = SimpleNamespace(hidden_size=hidden_size)
    modules = {name: factory(model_config, algo.cfg) for name, factory in algo.module_factories.items()}
    param_groups = [{"params": [logits], "lr": lr}]
    for module in modules.values():
        param_groups.append({"params": list(module.parameters()), "lr": lr * getattr(module, "lr_multiplier", 1.0)})
    optimizer = torch.optim.Adam(param_groups)
    prompt_embedding = torch.randn(1, 1, hidden_size, generator=gen)

    b = groups * group_size
    group_index = torch.arange(groups).repeat_interleave(group_size)
    mask = torch.ones(b, 1)
    scale = BatchScale(total_tokens=float(b), total_seqs=float(b), max_response_len=1)
    result = ToyResult(probs=torch.softmax(logits.detach(), 0))
    for step in range(1, steps + 1):
        with torch.no_grad():
            answers = torch.multinomial(torch.softmax(logits, 0), b, replacement=True, generator=gen)
        r = rewards_t[answers]
        advantages = algo.advantage(r, group_index, mask, algo.cfg)
        log_prob = torch.log_softmax(logits, 0)[answers][:, None]
        ctx = LossContext(cfg=algo.cfg, aggregate=partial(aggregate, mode=algo.cfg.loss_agg_mode, scale=scale),
                          ref_log_prob=log_ref[answers][:, None], hidden=prompt_embedding.expand(b, 1, hidden_size),
                          rewards=r, group_index=group_index, prompt_mask=torch.ones(b, 1), modules=modules)
        loss, metrics = algo.objective(log_prob, log_prob.detach(), advantages, mask, ctx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if record_every and (step % record_every == 0 or step == steps):
            probs = torch.softmax(logits.detach(), 0)
            result.history.append({"step": step, "loss": loss.item(), "probs": probs.tolist(), **metrics})
    result.probs = torch.softmax(logits.detach(), 0)
    return result


def modes_above(p: torch.Tensor, threshold: float = 0.05) -> int:
    """How many answers hold more than ``threshold`` of the mass."""
    return int((p > threshold).sum())


def describe(p: torch.Tensor, target: torch.Tensor) -> dict:
    return {"kl_to_target": kl(p, target), "kl_target_to_policy": kl(target, p), "entropy": entropy(p),
            "modes_over_5pct": modes_above(p), "max_prob": float(p.max()),
            "entropy_target": entropy(target), "log_k": math.log(len(p))}
