"""FlowRL refuses a KL-to-reference penalty in the reward: its target already has π_ref as prior."""

import pytest

from anabranch.algorithms import resolve_algorithm
from anabranch.config import ConfigError, load_config


def resolve(*overrides):
    return resolve_algorithm(load_config(None, list(overrides)).algorithm)


@pytest.mark.parametrize("reference", ["ref", "old", "none"])
def test_flowrl_with_kl_in_reward_is_refused_naming_the_keys(reference):
    with pytest.raises(ConfigError) as err:
        resolve("algorithm.name=flowrl", "algorithm.kl_coef=0.01", "algorithm.kl_in=reward",
                f"algorithm.flowrl.reference={reference}")
    msg = str(err.value)
    for key in ("algorithm.kl_in", "algorithm.kl_coef", "algorithm.flowrl.reference", "prior"):
        assert key in msg


def test_flowrl_with_adaptive_kl_in_reward_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.kl_in"):
        resolve("algorithm.name=flowrl", "algorithm.kl_coef=0.01", "algorithm.kl_target=6",
                "algorithm.kl_in=reward")


def test_neighbouring_combinations_still_resolve():
    # kl_in=reward without a KL (kl_coef=0) changes nothing and stays allowed; the loss-side KL and
    # KL-in-reward for reward-maximizing algorithms are untouched by the check.
    assert "ref_log_prob" in resolve("algorithm.name=flowrl", "algorithm.kl_in=reward").needs
    assert "ref_log_prob" in resolve("algorithm.name=flowrl", "algorithm.kl_coef=0.01").needs
    needs = resolve("algorithm.name=grpo", "algorithm.kl_coef=0.01", "algorithm.kl_in=reward").needs
    assert {"ref_log_prob", "old_log_prob"} <= needs
