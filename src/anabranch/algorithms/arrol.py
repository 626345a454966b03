"""ARRoL's quality head and its correctness-balanced pruning rule (the math; the rollout is trainer/arrol_rollouts.py).

Xu, Chen, Qiu, Yan, Luo, Cheng, He, Tong 2026, "Prune as You Generate: Online Rollout Pruning for Faster and
Better RLVR" (ARRoL, arXiv 2603.24840, ACL 2026). A lightweight quality head q_φ, trained on the fly, reads
the policy's hidden state at the end of a *partial* rollout (prompt ⊕ its first L_p response tokens) and
predicts the probability that the finished rollout will be correct:

    p_i = σ(q_φ(h_ℓ(x ⊕ y_{i,<L_p})))                       (h_ℓ: layer ℓ's hidden state, last position)
    L(φ) = −(1/B) Σ_i [c_i log p_i + (1 − c_i) log(1 − p_i)]   (c_i ∈ {0,1}: the finished rollout's correctness)

At the pruning point each prompt's n' = round(n·(1 + oversample)) partial rollouts are cut to n survivors
chosen so that the survivors are correctness-balanced around the target positive ratio ρ:

    k = ⌊ρ·n + ½⌋;   survivors = the k rollouts of highest p  ∪  the n − k rollouts of lowest p

(disjoint because n <= n'). The n' − n rollouts of middling p are pruned: they stop generating.

The survivors are chosen by the head itself, so their outcomes alone are a biased training set (the head never
sees how the middle of its ranking ends). The probe (``rollout.arrol.head_probe`` = f, trainer/arrol_probe.py)
also finishes k_p = ⌊f·m + ½⌋ of each group's m = n' − n pruned prefixes, drawn uniformly, for the head only, and
weighs every finished prefix by 1/P(finished) (1 for a survivor, m/k_p for a probed one):

    L(φ) = Σ_i w_i·BCE(p_i, c_i) / Σ_i w_i      (Σ_i w_i = n' per group: an unbiased estimate of the mean over all n')

At test time (``anabranch eval --arrol-vote``, eval/arrol_vote.py) each sample's answer votes with weight p_i:
â = argmax_a Σ_{i: ans_i = a} p_i (eval/passk.majority_correct with ``weights``).

Confirmed (the abstract; a third-party summary of the method section, emergentmind.com/papers/2603.24840):
the head predicts a partial rollout's success probability and is trained online; the pruning steers the
survivors towards a target positive-reward ratio, "usually ρ = 0.5"; the survivors are re-batched for the
log-probs and the update; the head also weighs candidates at test time (the weighted vote above: its form is
assumed). The authors' code was not released when this was written (github.com/Hsu1023/ARRoL held only a README).

**Assumed** (the paper's method text was not readable here): the exact keep rule above (the extremes of the
predicted ranking, k of them from the top — the ones most surely correct — and n − k from the bottom, so that
the survivors' expected positive count is driven towards ρ·n whatever the prompt's difficulty); the head's
form (linear, or a one-hidden-layer MLP), its input (one layer's hidden state at the prefix's last token, fp32)
and its loss (BCE on the verifier's right/wrong flag of the finished rollout); the over-sampling factor, the
pruning length and the warm-up (see trainer/arrol_rollouts.py); the probe and its importance weights are this
library's remedy for the survivor bias, not the paper's (whose training set for the head is not known here).
"""

from __future__ import annotations

import torch


class QualityHead(torch.nn.Module):
    """q_φ: hidden state [.., H] -> logit [..]; linear (``hidden`` = 0) or one ReLU hidden layer of ``hidden`` units."""

    def __init__(self, size: int, hidden: int = 0):
        super().__init__()
        if hidden > 0:
            self.net = torch.nn.Sequential(torch.nn.Linear(size, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        else:
            self.net = torch.nn.Linear(size, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h).squeeze(-1)


def head_loss_sum(logits: torch.Tensor, correct: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i w_i·BCE(σ(logit_i), c_i) (summed: the caller divides by Σ w, all ranks' under DDP); ``weight`` None: all 1."""
    if weight is None:
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, correct.to(logits.dtype), reduction="sum")
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, correct.to(logits.dtype), reduction="none")
    return (bce * weight.to(bce.dtype)).sum()


def probe_count(pruned: int, fraction: float) -> int:
    """k_p = ⌊fraction·m + ½⌋ of a group's m pruned prefixes finished for the head only (the probe), within [0, m]."""
    return min(max(int(fraction * pruned + 0.5), 0), pruned)


def probe_columns(keep: torch.Tensor, n_prime: int, fraction: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """The probe: [G, k_p] columns (ascending) drawn uniformly without replacement among each group's m = n' − n
    pruned columns (those not in ``keep`` [G, n]), and the importance weight m / k_p of each (1 / its inclusion
    probability k_p / m; a survivor's is 1). Over a group's n' prefixes the weighted sum of any per-prefix quantity
    over survivors ∪ probe is then an unbiased (Horvitz–Thompson) estimate of its sum over all n', and the weights
    sum to n' exactly. k_p = 0 (nothing probed) gives weight 0."""
    g, n = keep.shape
    m = n_prime - n
    k = probe_count(m, fraction)
    cols = []
    for row in keep.tolist():
        kept = set(row)
        pruned = torch.tensor([j for j in range(n_prime) if j not in kept], dtype=torch.long)
        pick = torch.randperm(m, generator=generator)[:k]
        cols.append(torch.sort(pruned[pick]).values)
    out = torch.stack(cols) if cols else torch.zeros(0, k, dtype=torch.long)
    return out, (m / k if k > 0 else 0.0)


def keep_count(n: int, target_ratio: float) -> int:
    """k = ⌊ρ·n + ½⌋: survivors taken from the top of the predicted ranking (round half up, not Python's)."""
    return min(max(int(target_ratio * n + 0.5), 0), n)


def balanced_keep(probs: torch.Tensor, n: int, target_ratio: float) -> torch.Tensor:
    """[G, n] column indices (ascending) of each group's survivors among its n' columns of ``probs`` [G, n']:
    the k = keep_count(n, ρ) of highest predicted success and the n − k of lowest (ties: the earlier column
    ranks higher, so the rule is deterministic)."""
    g, n_prime = probs.shape
    if n > n_prime:
        raise ValueError(f"cannot keep {n} of {n_prime} rollouts per prompt")
    k = keep_count(n, target_ratio)
    order = torch.sort(probs.float(), dim=1, descending=True, stable=True).indices
    keep = torch.cat([order[:, :k], order[:, n_prime - (n - k):]], dim=1)
    return torch.sort(keep, dim=1).values


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """ROC AUC of ``scores`` for 0/1 ``labels`` (ties count ½); None when only one class is present."""
    pos, neg = scores[labels > 0.5].float(), scores[labels <= 0.5].float()
    if pos.numel() == 0 or neg.numel() == 0:
        return None
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())
