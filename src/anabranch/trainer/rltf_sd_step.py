"""RLTF-SD in the training step (algorithms/rltf_sd.py): the retries to distil, their first-turn batch, the loss.

Each step, after the rollouts are scored:

1. The attempts k >= 2 of each "Try again" episode with a non-zero weight w_{i,k} (``distill_spans``, on
   the scored rollout's own loss mask and per-attempt grades, before any filter empties rows).
2. Each becomes ``prompt + attempt k``: the rollout's own prompt tokens (x₀: no earlier attempt, no
   feedback) then the attempt's sampled tokens, its EOS included when it wrote one; only the attempt's
   tokens are targets (HPT's :class:`SFTBatch` layout, the ids taken as sampled, not re-tokenized).
3. ``λ · Σ −w·log π_θ / N`` over them runs as ``policy_update``'s ``extra_loss`` (its own forward and
   backward into the same gradient and optimizer step, once per PPO epoch), combined with the other
   extra terms (DPH-RL, HPT, RL-PLUS) by ``combine_extra_losses``.

Data parallel (plain DDP), as HPT's term: each rank distils its own groups' retries, scaled
``Σ_rank · W / N`` with N the all-reduced distilled token count, so DDP's average over the W ranks is the
one-process term; ``policy_update`` runs it inside no_sync before its last micro-batch. A rank with
nothing to distil still takes part in the count's all-reduce. FSDP and DeepSpeed are refused.

Metrics: ``rltf/distilled_frac`` (the fraction of episodes with at least one distilled retry),
``rltf/sd_loss`` (Σ −w·log π / N, the term before λ; 0 on a step with nothing to distil).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from anabranch.algorithms.rltf_sd import distill_spans, weighted_nll
from anabranch.config import Config
from anabranch.models.logprobs import response_forward
from anabranch.rollout.base import Rollout, left_padded
from anabranch.trainer.distributed import require_plain_ddp
from anabranch.trainer.hpt_step import SFTBatch


def first_turn_batch(rollout: Rollout, spans, pad: int) -> tuple[SFTBatch, torch.Tensor]:
    """``[prompt (left-padded) | attempt tokens (right-padded)]`` for each span, and the spans' weights."""
    prompts = [rollout.prompt_ids[s.row][rollout.prompt_mask[s.row] > 0].tolist() for s in spans]
    targets = [rollout.response_ids[s.row, s.columns].tolist() for s in spans]
    prompt_ids, prompt_mask = left_padded(prompts, pad)
    width = max(len(t) for t in targets)
    t_ids = torch.full((len(targets), width), pad, dtype=torch.long)
    t_mask = torch.zeros((len(targets), width), dtype=torch.long)
    for i, t in enumerate(targets):
        t_ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        t_mask[i, :len(t)] = 1
    batch = SFTBatch(torch.cat([prompt_ids, t_ids], 1), torch.cat([prompt_mask, t_mask], 1), t_mask)
    return batch, torch.tensor([s.weight for s in spans], dtype=torch.float32)


def sd_extra_loss(model, batch: SFTBatch | None, weight: torch.Tensor | None, coef: float, temperature: float,
                  micro_batch_size: int, backward: Callable[[torch.Tensor], None] | None = None,
                  total_tokens: float | None = None, world_size: int = 1) -> Callable[[], dict]:
    """The ``policy_update(extra_loss=...)`` callable: forward + backward of ``coef · L_SD`` over ``batch``
    in micro-batches, returning ``rltf/sd_loss``. DDP: ``batch`` is this rank's share (None: nothing),
    ``total_tokens`` the distilled tokens of all ranks; loss and metric × W / total (HPT's scaling)."""
    backward = backward or (lambda loss: loss.backward())
    local = 0.0 if batch is None else float(batch.target_mask.sum())
    total = max(float(total_tokens if total_tokens is not None else local), 1.0)
    micro = max(micro_batch_size, 1)

    def run() -> dict:
        if batch is None:  # nothing to distil on this rank: no forward, its zero share of the metric
            return {"rltf/sd_loss": 0.0}
        device = next(model.parameters()).device
        loss_sum = 0.0
        for i in range(0, batch.input_ids.shape[0], micro):
            sl = slice(i, i + micro)
            lp = response_forward(model, batch.input_ids[sl].to(device), batch.attention_mask[sl].to(device),
                                  batch.response_len, temperature).log_probs
            loss, part = weighted_nll(lp, batch.target_mask[sl].to(device), weight[sl].to(device), total)
            backward(coef * loss * world_size)  # × W: DDP averages the ranks' gradients
            loss_sum += part
        return {"rltf/sd_loss": loss_sum * world_size / total}

    return run


@dataclasses.dataclass
class RLTFSDStep:
    """One step's distillation batch (None: nothing to distil here), its weights and metrics."""

    batch: SFTBatch | None
    weight: torch.Tensor | None
    metrics: dict

    def extra_loss(self, sd: "RLTFSD", model, dist=None) -> Callable[[], dict] | None:
        """None when nothing is distilled (under DDP: on no rank; every rank must call this, it all-reduces
        the distilled token count)."""
        world = 1 if dist is None else dist.world_size
        total = 0.0 if self.batch is None else float(self.batch.target_mask.sum())
        if world > 1:
            total = dist.all_reduce_sum(torch.tensor([total], dtype=torch.float64))[0].item()
        if total == 0:
            # the key is logged on every step (and every rank), as mean_metrics needs the same keys
            self.metrics["rltf/sd_loss"] = 0.0
            return None
        c = sd.cfg
        return sd_extra_loss(model, self.batch, self.weight, c.algorithm.rltf_sd_coef, c.rollout.temperature,
                             c.trainer.micro_batch_size, None if dist is None else dist.backward,
                             total_tokens=total, world_size=world)


class RLTFSD:
    """What the training loop holds for RLTF-SD: the config and pad id; :meth:`step` builds each step's batch."""

    def __init__(self, cfg: Config, tokenizer, dist=None):
        self.cfg = cfg
        # DDP with several ranks (the metric's mean over every rank's episodes); None: one process.
        self.dist = dist if dist is not None and getattr(dist, "world_size", 1) > 1 else None
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def create(cls, cfg: Config, dist, c) -> "RLTFSD | None":
        """None unless ``algorithm.rltf_sd_coef > 0``; refuses FSDP/DeepSpeed (before any work)."""
        if cfg.algorithm.rltf_sd_coef <= 0:
            return None
        require_plain_ddp(dist, "algorithm.rltf_sd_coef", "RLTF-SD's distillation term runs its own forward and "
                          "backward beside the RL micro-batches, on the ranks that have retries to distil",
                          "algorithm.rltf_sd_coef=0")
        return cls(cfg, c.tokenizer, dist)

    def step(self, rollout: Rollout) -> RLTFSDStep:
        """``rollout``: the scored rollout (its own loss mask and per-attempt grades, before any filter)."""
        if rollout.attempt_correct is None or rollout.loss_mask is None:
            raise RuntimeError("algorithm.rltf_sd_coef > 0 needs each attempt's grade from a multi-attempt rollout "
                               "(rollout.retry_turns >= 2); this batch has none")
        spans = distill_spans(rollout.loss_mask * rollout.response_mask.to(rollout.loss_mask.dtype),
                              rollout.attempt_correct, rollout.group_index, self.cfg.algorithm.rltf_sd_weighting)
        rows = rollout.response_ids.shape[0]
        metrics = {"rltf/distilled_frac": len({s.row for s in spans}) / max(rows, 1)}
        if self.dist is not None:  # the fraction of every rank's episodes, not of this one's
            metrics = self.dist.group_means(metrics, ("rltf/distilled_frac",), rows)
        if not spans:
            return RLTFSDStep(None, None, metrics)
        batch, weight = first_turn_batch(rollout, spans, self.pad)
        return RLTFSDStep(batch, weight, metrics)
