"""RoRecomp's split of a step's responses into the priority batch and the rest.

Paper: Gang Li, Yulei Qin, Xiaoyu Tan, Dingkang Yang, Yuchen Shi, Zihan Xu, Xiang Li, Xing Sun, Ke Li,
"RoRecomp: Enhancing Reasoning Efficiency via Rollout Response Recomposition in Reinforcement Learning",
2025, arXiv 2509.25958 (Tencent Youtu Lab).

Rule implemented (per group g of n responses, c_i ∈ {0, 1} right/wrong, ℓ_i the response length):

    C_g = {i : c_i = 1} sorted by ℓ ascending,   W_g = {i : c_i = 0} sorted by ℓ descending
    k(m) = max(1, ⌊α·m⌋) for m > 0, k(0) = 0                       (α = algorithm.rorecomp_fraction)
    priority_g = first k(|C_g|) of C_g  ∪  first k(|W_g|) of W_g     (ties: the earlier row first)

Every other response of the group is "remaining": it goes to the compensation replay buffer
(trainer/rorecomp.py) and is trained in a later step.

Confirmed (the paper's abstract; its full method text was not available to us): responses are
separated into *priority batches* that combine short-correct and long-incorrect responses selected
from the online batch (a clear gradient signal for brevity, the reward is not changed), and
*compensation batches* of the remaining responses drawn from a replay buffer (stability, no
collapse). **Assumed** here: the selection is per group with one fraction α for both sides and the
floor-at-least-one count k(m) above; right/wrong is full credit on the correctness reward; the
advantages are the run's estimator on the *whole* group before the split (the group baseline sees
all n samples, so the priority rows' signs are those of plain GRPO); the buffer's policy (FIFO cap,
optional age limit, a compensation batch once enough rows wait, rows replayed with the advantages
of their own step and the run's clipped ratio π_θ/π_s to the policy π_s that sampled them) is
documented in trainer/rorecomp.py.
"""

from __future__ import annotations

import torch


def side_count(m: int, fraction: float) -> int:
    """k(m) = max(1, ⌊α·m⌋) for m > 0 (a side that has responses always gives one), 0 for m = 0."""
    if m <= 0:
        return 0
    return max(1, int(fraction * m + 1e-9))  # + 1e-9: α·m that is an integer in exact arithmetic stays so


def priority_mask(correct: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor,
                  fraction: float) -> torch.Tensor:
    """[B] bool: the priority rows, the shortest k(|C_g|) correct and the longest k(|W_g|) wrong
    responses of each group (module docstring)."""
    correct = correct.bool().cpu()
    lengths = lengths.cpu().tolist()
    groups = group_index.cpu().tolist()
    keep = torch.zeros(len(groups), dtype=torch.bool)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g), []).append(i)
    for rows in members.values():
        right = [i for i in rows if correct[i]]
        wrong = [i for i in rows if not correct[i]]
        # sorted() is stable and rows are in batch order: equal lengths keep the earlier row first.
        short_right = sorted(right, key=lambda i: lengths[i])[:side_count(len(right), fraction)]
        long_wrong = sorted(wrong, key=lambda i: -lengths[i])[:side_count(len(wrong), fraction)]
        keep[short_right + long_wrong] = True
    return keep
