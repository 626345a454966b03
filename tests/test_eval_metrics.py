"""pass@k, maj@k, diversity, the reward–entropy fit and the Model Collapse Step against
brute force and hand-computed values."""

import itertools
import math

import numpy as np
import pytest

from anabranch.eval.collapse import model_collapse_step
from anabranch.eval.diversity import (distinct_answers, distinct_n, group_distinct_answers,
                                      mean_pairwise_cosine_distance, pca_2d)
from anabranch.eval.entropy_law import fit_reward_entropy
from anabranch.eval.passk import default_ks, maj_at_k, majority_correct, pass_at_k, sample_metrics


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        labels = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(labels, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_large_n_is_stable():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 − C(3,2)/C(4,2) = 1 − 3/6
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 3, 8) == 1.0                # n − c < k
    # C(1000, 500) overflows a float; the product form does not.
    exact = 1 - math.comb(990, 500) / math.comb(1000, 500)
    assert pass_at_k(1000, 10, 500) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_on_hand_made_votes():
    # "7" wins 3 to 2: correct.
    assert majority_correct(["7", "7", "3", "3", "7"], [1, 1, 0, 0, 1]) == 1.0
    # "3" wins: wrong, even though two samples are right.
    assert majority_correct(["3", "3", "3", "7", "7"], [0, 0, 0, 1, 1]) == 0.0
    # A 2–2 tie between a right and a wrong answer: half credit (random tie-break).
    assert majority_correct(["7", "3", "7", "3"], [1, 0, 1, 0]) == 0.5
    # Samples without an answer do not vote.
    assert majority_correct([None, None, None, "7"], [0, 0, 0, 1]) == 1.0
    assert majority_correct([None, None], [0, 0]) == 0.0


def test_maj_at_k_is_the_mean_over_k_subsets():
    answers = ["7", "7", "3", "5", "3", "3"]
    correct = [a == "7" for a in answers]
    assert maj_at_k(answers, correct, 6) == 0.0          # "3" wins all six
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 6)
    # k = 2: of the 15 pairs, {7,7} wins (1), {7,x≠7} ties half (2·4 = 8 pairs · 0.5) -> 5/15.
    assert maj_at_k(answers, correct, 2) == pytest.approx(5 / 15)
    # Sampled subsets (above the exact-enumeration limit) approach the exact value.
    big = ["7"] * 7 + ["3"] * 9
    approx = maj_at_k(big, [a == "7" for a in big], 7, max_subsets=2000)
    exact = maj_at_k(big, [a == "7" for a in big], 7, max_subsets=20000)  # C(16, 7) = 11440 subsets
    assert approx != exact and approx == pytest.approx(exact, abs=0.04)


def test_sample_metrics_averages_over_problems():
    correct = [[True, False, False, False], [True, True, True, True]]
    answers = [["1", "2", "2", "3"], ["5", "5", "5", "5"]]
    m = sample_metrics(correct, answers, default_ks(4))
    assert list(m["pass@k"]) == ["1", "2", "4"]
    assert m["pass@k"]["1"] == pytest.approx((0.25 + 1) / 2)
    assert m["pass@k"]["2"] == pytest.approx((0.5 + 1) / 2)
    assert m["maj@k"]["4"] == pytest.approx((0 + 1) / 2)  # "2" wins the first problem
    assert m["mean@n"] == pytest.approx(0.625)
    with pytest.raises(ValueError, match="outside 1..n"):
        sample_metrics(correct, answers, [8])


def test_distinct_answers_and_distinct_n():
    assert distinct_answers(["7", "7", "3", None]) == 2
    assert group_distinct_answers(["7", "7", "3", "4", "4", "4"], [0, 0, 0, 1, 1, 1]) == pytest.approx(1.5)
    # "a b a b" has 1-grams a,b,a,b (2 unique of 4) and 2-grams ab,ba,ab (2 of 3).
    assert distinct_n(["a b a b"], 1) == pytest.approx(0.5)
    assert distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)
    assert distinct_n(["x y", "x y"], 2) == pytest.approx(0.5)  # identical completions repeat n-grams
    assert distinct_n(["", "x"], 2) == 0.0


def test_embedding_diversity_and_pca_on_constructed_vectors():
    same = np.ones((4, 3))
    assert mean_pairwise_cosine_distance(same) == pytest.approx(0.0)
    # Three orthogonal unit vectors: every pair has cosine 0 -> distance 1.
    assert mean_pairwise_cosine_distance(np.eye(3) * 5) == pytest.approx(1.0)
    # Opposite vectors: distance 2.
    assert mean_pairwise_cosine_distance([[1, 0], [-2, 0]]) == pytest.approx(2.0)
    # Pairs (e1,e1)=0, (e1,e2)=1, (e1,e2)=1 -> mean 2/3.
    assert mean_pairwise_cosine_distance([[1, 0], [1, 0], [0, 1]]) == pytest.approx(2 / 3)
    assert mean_pairwise_cosine_distance([[1, 0]]) == 0.0
    pts = np.array([[0, 0, 0], [2, 0, 0], [4, 0, 0], [0, 1, 0]], float)
    xy = pca_2d(pts)
    assert xy.shape == (4, 2)
    # The first component carries the x spread: pairwise distances are kept (points lie in a plane).
    d = lambda a: np.linalg.norm(a[:, None] - a[None], axis=-1)  # noqa: E731
    assert np.allclose(d(xy), d(pts))


def test_reward_entropy_fit_recovers_known_a_b():
    rng = np.random.default_rng(0)
    h = np.linspace(0.1, 1.5, 30)
    r = -0.3 * np.exp(h) + 1.2
    fit = fit_reward_entropy(h, r)
    assert (fit.a, fit.b) == (pytest.approx(0.3), pytest.approx(1.2))
    assert fit.r2 == pytest.approx(1.0) and fit.ceiling == pytest.approx(0.9)
    noisy = fit_reward_entropy(h, r + rng.normal(0, 0.01, h.size))
    assert noisy.a == pytest.approx(0.3, abs=0.02) and noisy.b == pytest.approx(1.2, abs=0.05)
    assert fit_reward_entropy([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]) is None  # no entropy spread


def test_reward_entropy_fit_r2_by_hand():
    # x = exp(H) = 1, 2, 3 and R = 1, 0, 0.5: least squares R = 1.0 − 0.25·x, predictions
    # 0.75, 0.5, 0.25, SS_res = 0.375, SS_tot = 0.5, so R² = 0.25.
    fit = fit_reward_entropy(np.log([1.0, 2.0, 3.0]), [1.0, 0.0, 0.5])
    assert (fit.a, fit.b, fit.r2, fit.n) == (pytest.approx(0.25), pytest.approx(1.0), pytest.approx(0.25), 3)


def test_reward_entropy_fit_refuses_degenerate_data():
    # Two points: any two-parameter curve passes through them, R² = 1 would mean nothing.
    assert fit_reward_entropy([0.2, 0.9], [0.1, 0.7]) is None
    # A constant reward: SS_tot = 0 and R² is undefined (the old code reported 1.0).
    assert fit_reward_entropy([0.2, 0.5, 0.9, 1.3], [0.4] * 4) is None
    # NaN rows are dropped before counting: two finite points are left.
    assert fit_reward_entropy([0.2, float("nan"), 0.9], [0.1, 0.5, 0.7]) is None


def test_model_collapse_step():
    steps = [0, 10, 20, 30, 40, 50]
    acc = [0.30, 0.42, 0.50, 0.47, 0.38, 0.20]
    out = model_collapse_step(steps, acc, margin=0.1)
    assert out["collapse_step"] == 20 and out["fell_at_step"] == 40 and out["peak_accuracy"] == 0.5
    rising = model_collapse_step(steps, [0.1, 0.2, 0.3, 0.28, 0.35, 0.4], margin=0.1)
    assert rising["collapse_step"] is None and rising["peak_step"] == 50
    with pytest.raises(ValueError):
        model_collapse_step([1], [0.1], margin=0)


@pytest.mark.parametrize("completion,expected", [
    ("so the sum is 7", "7"), ("7.0", "7"), ("the answer is 14/2", "7"), ("\\boxed{1,000}", "1000"),
    ("\\boxed{0.5}", "0.5"), ("Answer: x+1", "x+1"), ("no answer here", None), ("", None),
])
def test_canonical_final_answers_merge_equal_numbers(completion, expected):
    from anabranch.eval.answers import extract_answer

    assert extract_answer(completion) == expected


def test_held_out_truth_falls_back_to_math_verify_for_label_free_rewards():
    from anabranch.config import RewardConfig, RewardFunctionConfig
    from anabranch.eval.accuracy import truth_source
    from anabranch.rewards import build_rewards

    label_free = build_rewards(RewardConfig(functions=[RewardFunctionConfig("majority_vote")]))
    assert truth_source(label_free, [{"answer": "3"}]).name == "math_verify"
    assert truth_source(label_free, [{"answer": None}]) is None  # no labels: no accuracy to report
    labelled = build_rewards(RewardConfig(functions=[RewardFunctionConfig("math_verify")]))
    assert truth_source(labelled, [{"answer": None}]).name == "math_verify"
