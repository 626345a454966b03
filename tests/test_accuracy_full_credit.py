"""Accuracy counts a sample as correct only at full credit (all tests passed, reasoning-gym's full
score), in training metrics, held-out accuracy and DAPO's dynamic sampling, as pass@k does."""

import torch

from anabranch.eval.accuracy import greedy_accuracy
from anabranch.rewards.compose import GuardSettings, RewardSource
from anabranch.trainer.collect import ScoredBatch, filter_signal, informative_groups
from anabranch.trainer.loop import rollout_metrics

from test_dapo_batch import fake_rollout

# code_tests in fraction mode: tests passed / tests.
FRACTIONS = [1.0, 0.5, 0.0, 2 / 3]


def fraction_reward(prompts, completions, **_):
    return [FRACTIONS[int(c[1:])] for c in completions]


def source():
    # "code_tests" is registered as a correctness reward; the function stands in for its sandbox.
    return RewardSource("code_tests", 1.0, fraction_reward, {}, guard=GuardSettings(isolation="none"))


def test_training_accuracy_is_the_fraction_of_full_credit_samples():
    ro = fake_rollout(2, 2, 2, 3)
    out = rollout_metrics(torch.tensor(FRACTIONS), {"code_tests": FRACTIONS}, ro, source())
    assert out["reward/code_tests"] == sum(FRACTIONS) / 4  # the mean score is still logged
    assert out["accuracy"] == 0.25                          # one of four passed every test


class Backend:
    def generate(self, prompts, n, greedy=False, max_new_tokens=None):
        ro = fake_rollout(len(prompts), 1, 2, 3)
        ro.completions = [f"c{i}" for i in range(len(prompts))]
        return ro


def test_held_out_accuracy_counts_full_credit_only():
    rows = [{"prompt": f"p{i}", "answer": ""} for i in range(4)]
    res = greedy_accuracy(Backend(), [r["prompt"] for r in rows], rows, [source()], 8)
    assert res["accuracy"] == 0.25 and res["scores"] == FRACTIONS
    assert greedy_accuracy(Backend(), [r["prompt"] for r in rows], rows, [source()], 8,
                           threshold=0.5)["accuracy"] == 0.75


def test_dynamic_sampling_drops_groups_with_no_sample_fully_right():
    ro = fake_rollout(2, 2, 2, 3)
    # Group 0: partial scores 0.5 and 2/3, no sample right: no accuracy signal. Group 1: right, wrong.
    values = [0.5, 2 / 3, 1.0, 0.0]
    batch = ScoredBatch(ro, [{}] * 4, values, {"code_tests": values}, 0.0)
    signal = filter_signal(batch, [source()], "accuracy")
    assert signal.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert informative_groups(signal, ro.group_index) == [1]
    assert informative_groups(filter_signal(batch, [source()], "reward"), ro.group_index) == [0, 1]
