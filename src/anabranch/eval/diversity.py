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
- Self-BLEU (Zhu et al. 2018, "Texygen: A Benchmarking Platform for Text Generation Models"):
  each completion scored with BLEU (Papineni et al. 2002, "BLEU: a Method for Automatic
  Evaluation of Machine Translation") against all the other completions of the same problem as
  references, then averaged; higher = more alike, so lower = more diverse. See :func:`self_bleu`.
"""

from __future__ import annotations

import random

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


# Self-BLEU's defaults: BLEU-4 with uniform weights, as in Texygen and in BLEU itself; 64 scored
# hypotheses per problem at most (the cost grows with the hypotheses times the references).
SELF_BLEU_MAX_ORDER = 4
SELF_BLEU_MAX_HYPOTHESES = 64


def self_bleu(completions: list[str], max_order: int = SELF_BLEU_MAX_ORDER,
              max_hypotheses: int = SELF_BLEU_MAX_HYPOTHESES, seed: int = 0) -> float | None:
    """Self-BLEU of one problem's completions, in [0, 1] (1: all identical; lower = more diverse).

    Self-BLEU = (1/|H|) Σ_{i∈H} BLEU(c_i; {c_j : j ≠ i}), with, for hypothesis h and references R,
    BLEU = BP · exp(Σ_{n=1..N} (1/N) ln p_n), p_n = Σ_g min(count_h(g), max_{r∈R} count_r(g)) /
    Σ_g count_h(g) over the n-grams g of h, BP = 1 if |h| ≥ ρ else exp(1 − ρ/|h|), ρ the reference
    length closest to |h| (Papineni et al. 2002). Other completions with the same text count as
    references: duplicates are what makes Self-BLEU high.

    Computed with sacrebleu (its n-gram extraction and its ``BLEU.compute_bleu`` for smoothing,
    brevity penalty and geometric mean), on the 0–1 scale (sacrebleu's score / 100):

    - tokens: whitespace-split, the tokens of :func:`distinct_n` (sacrebleu's ``tokenize='none'``;
      its default 13a tokenizer would split punctuation and make the two metrics count different
      tokens).
    - smoothing: sentence BLEU of short texts often has no matching 4-gram, and one zero
      precision makes the unsmoothed geometric mean 0. We use Chen & Cherry 2014's method 1
      (sacrebleu ``floor``, ε = 0.1: a zero count becomes 0.1 / Σ_g count_h(g)), the smoothing of
      Texygen's Self-BLEU (NLTK's ``method1``), and sacrebleu's ``effective_order`` (a hypothesis
      shorter than n words uses only the orders it has), as sacrebleu recommends for sentence BLEU.
    - an empty completion scores 0 (no n-grams; BLEU is undefined there and sacrebleu returns 0).
    - the clipped counts are computed once per problem, not by one ``sentence_score`` call per
      hypothesis: max over the *other* completions of count(g) is the largest count unless the
      hypothesis alone holds it, then the second largest. ``tests/test_self_bleu.py`` checks the
      result equals sacrebleu's ``sentence_score(c_i, others)``.

    None for fewer than 2 completions (no references). With more than ``max_hypotheses``
    completions, H is a fixed subset of ``max_hypotheses`` of them drawn with ``random.Random(seed)``
    (same completions, same subset); each is still scored against all the others.
    """
    from sacrebleu.metrics.bleu import BLEU
    from sacrebleu.metrics.helpers import extract_all_word_ngrams

    if max_order < 1:
        raise ValueError(f"Self-BLEU needs max_order >= 1 (got {max_order})")
    if max_hypotheses < 1:
        raise ValueError(f"Self-BLEU needs max_hypotheses >= 1 (got {max_hypotheses})")
    k = len(completions)
    if k < 2:
        return None
    counts, lengths = zip(*(extract_all_word_ngrams(c, 1, max_order) for c in completions))
    top: dict[tuple, list[int]] = {}  # n-gram -> its two largest counts over the completions
    for cnt in counts:
        for gram, c in cnt.items():
            best = top.setdefault(gram, [0, 0])
            if c > best[0]:
                best[0], best[1] = c, best[0]
            elif c > best[1]:
                best[1] = c
    chosen = range(k) if k <= max_hypotheses else sorted(random.Random(seed).sample(range(k), max_hypotheses))
    scores = []
    for i in chosen:
        correct, total = [0] * max_order, [0] * max_order
        for gram, c in counts[i].items():
            a, b = top[gram]
            ref_max = b if c == a else a  # if another completion also holds a, then b == a
            correct[len(gram) - 1] += min(c, ref_max)
            total[len(gram) - 1] += c
        others = [n for j, n in enumerate(lengths) if j != i]
        # The reference length closest to the hypothesis's, the shorter on a tie (as sacrebleu).
        ref_len = min(others, key=lambda n: (abs(n - lengths[i]), n))
        score = BLEU.compute_bleu(correct, total, lengths[i], ref_len, smooth_method="floor",
                                  smooth_value=0.1, effective_order=True, max_ngram_order=max_order).score
        scores.append(min(score / 100.0, 1.0))  # the float sum can land a hair above 100
    return float(np.mean(scores))


def mean_self_bleu(groups: list[list[str]], **kwargs) -> float | None:
    """Self-BLEU averaged over problems; problems with fewer than 2 completions are skipped (None
    when none has 2)."""
    values = [v for v in (self_bleu(g, **kwargs) for g in groups) if v is not None]
    return float(np.mean(values)) if values else None
