"""CalibRL in the training step (algorithms/calibrl.py): each group's expert baseline, before the update.

Each step, after the rollouts are scored and before the update changes the policy:

1. One expert solution per prompt (group): ``row["demonstration"]`` (``task.demonstration_column``), else
   ``algorithm.calibrl.demonstration_template`` filled with the row's answer (``group_demonstrations``, shared
   with HPT and RL-PLUS), tokenized after the exact prompt text the rollout used (``build_sft_batch``).
2. Its token log-probs under π_old: one forward without gradient (RL-PLUS's ``demonstration_pass``),
   at the rollout temperature. The expert is not scored, not trained, and not counted in any group statistic.
3. Each rollout row gets its group's baseline b_t over the rollout's response width
   (``precomputed["calibrl_baseline"]``, [B, T]); ``policy_update`` adds λ·agg(|Â|·LeakyReLU_α(...)) on the
   same forward as the RL loss (trainer/step.py), so off costs nothing and on costs one no-grad forward of
   one expert per prompt.

Data parallel (plain DDP): each rank scores the experts of its own groups; the term is per row, aggregated with
the RL loss's global normalizers, so DDP's gradient average is the one-process gradient. No batch-level state.
FSDP and DeepSpeed are refused (``require_plain_ddp``): ranks with different numbers of expert forwards would
wait on each other in the sharded forward.
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.calibrl import expert_baseline
from anabranch.config import Config
from anabranch.rollout.base import Rollout
from anabranch.trainer.distributed import require_plain_ddp
from anabranch.trainer.hpt_step import check_demonstrations, group_demonstrations
from anabranch.trainer.rl_plus_step import demonstration_pass


@dataclasses.dataclass
class CalibRLStep:
    """One step's per-row expert baselines ([B, T]) and metrics."""

    baseline: torch.Tensor
    metrics: dict

    def precomputed(self, pre: dict) -> dict:
        return {**pre, "calibrl_baseline": self.baseline}


class CalibRL:
    """What the training loop holds for CalibRL: config and tokenizer; :meth:`step` each step."""

    def __init__(self, cfg: Config, tokenizer):
        self.cfg, self.c, self.tokenizer = cfg, cfg.algorithm.calibrl, tokenizer

    @classmethod
    def create(cls, cfg: Config, dist, c) -> "CalibRL | None":
        """None unless ``algorithm.calibrl.enabled``; refuses sharded training and training rows with no expert
        solution and no answer, before any work (the config itself is checked first: config_checks)."""
        if not cfg.algorithm.calibrl.enabled:
            return None
        require_plain_ddp(dist, "algorithm.calibrl.enabled", "CalibRL scores each rank's own expert solutions "
                          "in a forward of its own", "algorithm.calibrl.enabled=false")
        check_demonstrations(c.train_rows, cfg, "calibrl")
        return cls(cfg, c.tokenizer)

    def step(self, batch, rollout: Rollout, model) -> CalibRLStep:
        """``batch``: the scored batch (groups, rows); ``rollout``: the one the update trains on (its width);
        ``model``: the policy before the update (π_old)."""
        groups = rollout.group_index
        demos = group_demonstrations(batch, self.c.demonstration_template, group_index=groups)
        sft, old = demonstration_pass(model, self.tokenizer, demos.prompts, demos.texts,
                                      self.c.max_demonstration_tokens, self.cfg)
        per_group = expert_baseline(old, sft.target_mask, rollout.response_ids.shape[1], self.c.baseline)
        _, slot = groups.unique(return_inverse=True)  # each row's group's place in demos.groups (both ascending)
        baseline = per_group[slot]
        metrics = {"calibrl/expert_logprob": float(masked_mean(old, sft.target_mask)),
                   "calibrl/expert_tokens": float(sft.target_mask.sum()) / max(len(demos.groups), 1)}
        return CalibRLStep(baseline, metrics)
