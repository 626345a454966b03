"""Diversity of a set of completions: distinct final answers, distinct-n, embedding diversity,
and a 2-D PCA projection for maps.

- distinct answers: the number of different final answers among a problem's samples.
- distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural Conversation
  Models"): unique n-grams / total n-grams over all the completions (whitespace tokens). Li et
  al. divide by the number of generated tokens instead; the two agree for n = 1, and for n ≥ 2
  this (the common implementation) divides by the n-gram count, smaller by n − 1 per
  completion. A problem whose completions are all shorter than n has no n-grams: distinct-n 0.
- embedding diversity: mean pairwise cosine distance 1 − cos(e_i, e_j) over pairs i < j of
  sentence embeddings (see :mod:`anabranch.eval.embedding`).
"""

from __future__ import annotations

import numpy as np


def distinct_answers(answers: list) -> int:
    """Different final answers, not counting completions with none."""
    return len({a for a in answers if a is not None})


def distinct_n(completions: list[str], n: int) -> float:
    if n < 1:
        raise ValueError(f"distinct-n needs n >= 1 (got {n})")
    grams, total = set(), 0
    for text in completions:
        tokens = text.split()
        for i in range(len(tokens) - n + 1):
            grams.add(tuple(tokens[i:i + n]))
            total += 1
    return len(grams) / total if total else 0.0


def mean_pairwise_cosine_distance(embeddings) -> float:
    """Mean of 1 − cos over all pairs i < j; 0 for fewer than two vectors."""
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array [count, dim], got shape {e.shape}")
    m = e.shape[0]
    if m < 2:
        return 0.0
    norms = np.linalg.norm(e, axis=1, keepdims=True)
    unit = e / np.where(norms == 0, 1.0, norms)
    cos = unit @ unit.T
    iu = np.triu_indices(m, k=1)
    return float(np.mean(1.0 - cos[iu]))


def pca_2d(embeddings) -> np.ndarray:
    """Project onto the first two principal components (centered SVD); pads with zeros when the
    points span fewer than two dimensions."""
    e = np.asarray(embeddings, dtype=np.float64)
    centered = e - e.mean(axis=0, keepdims=True)
    _, _, vt = np.linalg.svd(centered, full_matrices=False)
    out = centered @ vt[:2].T
    if out.shape[1] < 2:
        out = np.pad(out, ((0, 0), (0, 2 - out.shape[1])))
    return out


def group_distinct_answers(answers: list, group_index: list[int]) -> float:
    """Mean over groups (prompts) of the number of distinct final answers among its samples."""
    groups: dict[int, list] = {}
    for a, g in zip(answers, group_index):
        groups.setdefault(int(g), []).append(a)
    return sum(distinct_answers(v) for v in groups.values()) / max(len(groups), 1)
