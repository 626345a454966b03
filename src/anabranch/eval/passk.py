"""pass@k, maj@k and mean@k from n sampled completions per problem.

pass@k, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"): with n samples of which c are correct, the probability that a random k-subset holds at
least one correct sample is

    pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)

The product form avoids the huge binomials. maj@k is the expected correctness of the majority
answer of a random k-subset (ties split evenly, as a random tie-break would); mean@n is c/n, the
mean accuracy of one sample, which is also the expectation of mean accuracy over any k samples.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_correct(answers: list, correct: list[bool], weights: list[float] | None = None) -> float:
    """Correctness of the most common answer among ``answers`` (``None`` = no answer, no vote).

    Samples with the same answer share one correctness (the fraction of them marked correct, so a
    verifier that disagrees with itself counts in part). A tie between the top answers gives the
    mean over them, the expected value of a random tie-break. ``weights``: each sample's vote counts
    its weight instead of 1 (ARRoL's head-weighted vote, eval/arrol_vote.py); None is the plain vote.
    """
    votes = Counter(a for a in answers if a is not None)
    if weights is not None:
        votes = Counter()
        for a, w in zip(answers, weights, strict=True):
            if a is not None:
                votes[a] += float(w)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, v in votes.items() if v == top]
    score = 0.0
    for w in winners:
        marks = [bool(ok) for a, ok in zip(answers, correct) if a == w]
        score += sum(marks) / len(marks)
    return score / len(winners)


def maj_at_k(answers: list, correct: list[bool], k: int, max_subsets: int = 2000, seed: int = 0) -> float:
    """Expected majority-vote correctness over k-subsets of the n samples: exact when there are
    at most ``max_subsets`` subsets, else the mean over ``max_subsets`` random ones (seeded)."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n (got n={n}, k={k})")
    if math.comb(n, k) <= max_subsets:
        subsets = itertools.combinations(range(n), k)
        count = math.comb(n, k)
    else:
        rng = random.Random(seed)
        subsets = (rng.sample(range(n), k) for _ in range(max_subsets))
        count = max_subsets
    total = 0.0
    for idx in subsets:
        total += majority_correct([answers[i] for i in idx], [correct[i] for i in idx])
    return total / count


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, with n itself always last."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def sample_metrics(per_problem_correct: list[list[bool]], per_problem_answers: list[list], ks: list[int]) -> dict:
    """Mean over problems of pass@k and maj@k for each k, and mean@n."""
    if not per_problem_correct:
        raise ValueError("no problems to score")
    n = len(per_problem_correct[0])
    if any(len(c) != n for c in per_problem_correct):
        raise ValueError("every problem needs the same number of samples n")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k values {bad} are outside 1..n={n}; pass --k with values up to the number of samples")
    m = len(per_problem_correct)
    return {
        "n": n,
        "pass@k": {str(k): sum(pass_at_k(n, sum(c), k) for c in per_problem_correct) / m for k in ks},
        "maj@k": {str(k): sum(maj_at_k(a, c, k) for a, c in zip(per_problem_answers, per_problem_correct)) / m
                  for k in ks},
        "mean@n": sum(sum(c) / n for c in per_problem_correct) / m,
    }
