"""FlowRL really matches reward distributions; GRPO on the same problem concentrates its mass.

The problem is small enough to enumerate (see :mod:`anabranch.eval.toy_matching`): one prompt,
8 single-token answers, a tabular softmax policy that starts at π_ref, trained with the registered
estimator and objective of each recipe (the functions the trainer calls). Thresholds:

- Equal rewards (answers 0-2 correct, π_ref 0.2/0.1/0.05 on them): the target π_ref·exp(15·r)/Z
  is π_ref restricted to the correct answers, 4:2:1 (wrong answers ~e^-15). π_ref itself is at
  KL 8.7 from it; FlowRL must end below 0.03 (measured 0.011 after 500 steps with every log Z
  source), while GRPO after as many steps piles its mass on the likeliest correct answer
  (measured max prob 0.86, KL 0.20) and keeps concentrating the longer it runs.
- Unequal rewards 1, .8, .6, .4, .2, 0, 0, 0 with β = 3 and centered (not std-normalized)
  rewards: with VarGrad log Z the fixed point is exactly π_ref·exp(β·r)/Z (the group mean of the
  reward cancels in the group variance), measured KL < 1e-4; GRPO puts > 95% on the best answer.
"""

import pytest

from anabranch.config import AlgorithmConfig, FlowRLConfig
from anabranch.eval.toy_matching import describe, target_distribution, train_tabular

REF = [0.2, 0.1, 0.05, 0.15, 0.15, 0.15, 0.1, 0.1]
EQUAL = [1, 1, 1, 0, 0, 0, 0, 0]
UNEQUAL = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0]
STEPS = 500


@pytest.fixture(scope="module")
def grpo_equal():
    return describe(train_tabular(AlgorithmConfig(name="grpo"), EQUAL, REF, steps=STEPS).probs,
                    target_distribution(REF, EQUAL, 15.0))


@pytest.mark.parametrize("log_z", ["head", "scalar", "vargrad"])
def test_flowrl_matches_equal_reward_target_and_grpo_does_not(log_z, grpo_equal):
    target = target_distribution(REF, EQUAL, 15.0)
    start = describe(target.new_tensor(REF), target)
    flow = describe(train_tabular(AlgorithmConfig(name="flowrl", flowrl=FlowRLConfig(log_z=log_z)),
                                  EQUAL, REF, steps=STEPS).probs, target)
    assert start["kl_to_target"] > 8.0
    assert flow["kl_to_target"] < 0.03, flow
    assert flow["modes_over_5pct"] == 3  # every correct answer keeps its share
    assert abs(flow["entropy"] - flow["entropy_target"]) < 0.05
    # GRPO: more than 7x further from the target, and lower entropy than the target.
    assert grpo_equal["kl_to_target"] > 0.1
    assert grpo_equal["max_prob"] > 0.8 and grpo_equal["entropy"] < flow["entropy"] - 0.3, grpo_equal


def test_vargrad_matches_unequal_reward_target_exactly_and_grpo_collapses():
    beta = 3.0
    uniform = [1 / 8] * 8
    target = target_distribution(uniform, UNEQUAL, beta)
    flow_cfg = AlgorithmConfig(name="flowrl", norm_adv_by_std=False, flowrl=FlowRLConfig(beta=beta, log_z="vargrad"))
    flow = describe(train_tabular(flow_cfg, UNEQUAL, uniform, steps=300).probs, target)
    grpo = describe(train_tabular(AlgorithmConfig(name="grpo"), UNEQUAL, uniform, steps=300).probs, target)
    assert describe(target.new_tensor(uniform), target)["kl_to_target"] > 0.5
    assert flow["kl_to_target"] < 1e-3, flow
    assert flow["modes_over_5pct"] == 4  # target: .44 .24 .13 .07 .04 .02 .02 .02
    assert grpo["max_prob"] > 0.95 and grpo["kl_to_target"] > 0.5, grpo
