"""Weighted GRPO (Sheng et al. 2026, "Beyond Variance", arXiv 2602.03452): hand-computed advantages of a
q+ and a q− group, the config refusals, the q+/q− roles from the pairing sampler (fresh and resumed),
and a short paired run on the tiny model."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms import ADVANTAGES, resolve_algorithm
from anabranch.algorithms.weighted_grpo import weighted_grpo_advantage
from anabranch.config import AlgorithmConfig, Config, ConfigError
from anabranch.config_checks import check_whole_config
from anabranch.trainer.prompt_pairing import PromptPairing
from test_prompt_pairing import fake_components, paired_cfg, pairing_run, rate_task

# One q+ group (1 success of 4) then one q− group (1 failure of 4), binary outcomes.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
ROLES = torch.tensor([1, 1, 1, 1, -1, -1, -1, -1])


def algo_cfg(**kw):
    return dataclasses.replace(AlgorithmConfig(), advantage="weighted_grpo", loss="ppo_clip", **kw)


def test_advantages_match_the_hand_computed_values():
    # Both groups: mean 1/4 resp. 3/4; unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5.
    # q+: (r − 0.25)/0.5 = [1.5, −0.5, −0.5, −0.5]; q−: λ·(r − 0.75)/0.5 = 3·[0.5, 0.5, −1.5, 0.5].
    mask = torch.ones(8, 3)
    mask[0, 2] = 0  # a padded token gets no advantage
    adv = weighted_grpo_advantage(REWARDS, GROUPS, mask, algo_cfg(weighted_grpo_neg_weight=3.0), group_role=ROLES)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.5, 1.5, -4.5, 1.5])
    assert torch.allclose(adv[:, 0], expected, atol=1e-5)
    assert torch.equal(adv[:, 1], adv[:, 0]) and adv[0, 2] == 0 and adv[1, 2] == adv[1, 0]
    # The rare failure on q− is penalised λ_neg times as hard as q+'s rare success is rewarded.
    assert adv[6, 0] / adv[0, 0] == pytest.approx(-3.0)


def test_mean_centred_without_std_and_plain_grpo_at_weight_one():
    mask = torch.ones(8, 1)
    adv = weighted_grpo_advantage(REWARDS, GROUPS, mask, algo_cfg(weighted_grpo_neg_weight=2.0, norm_adv_by_std=False),
                                  group_role=ROLES)[:, 0]
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -1.5, 0.5]))
    # λ_neg = 1: GRPO's advantages, whatever the roles.
    one = weighted_grpo_advantage(REWARDS, GROUPS, mask, algo_cfg(), group_role=-ROLES)
    assert torch.allclose(one, ADVANTAGES.get("grpo")(REWARDS, GROUPS, mask, algo_cfg()))


def test_roles_are_required_and_checked():
    mask = torch.ones(8, 1)
    with pytest.raises(ConfigError, match=r"task\.pairing=true"):
        weighted_grpo_advantage(REWARDS, GROUPS, mask, algo_cfg())
    with pytest.raises(ValueError, match="group_role"):
        weighted_grpo_advantage(REWARDS, GROUPS, mask, algo_cfg(), group_role=torch.zeros(8))
    with pytest.raises(ValueError, match="group_role"):
        weighted_grpo_advantage(REWARDS, GROUPS, mask, algo_cfg(), group_role=ROLES[:4])


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_bad_neg_weight_is_refused_at_resolution(value):
    with pytest.raises(ConfigError, match=r"algorithm\.weighted_grpo_neg_weight"):
        resolve_algorithm(algo_cfg(weighted_grpo_neg_weight=value))


def test_neg_weight_without_weighted_grpo_is_refused():
    with pytest.raises(ConfigError, match=r"weighted_grpo_neg_weight=2\.0 has no effect"):
        resolve_algorithm(dataclasses.replace(AlgorithmConfig(), weighted_grpo_neg_weight=2.0))
    algo = resolve_algorithm(dataclasses.replace(AlgorithmConfig(), name="weighted_grpo", weighted_grpo_neg_weight=2.0))
    assert algo.cfg.advantage == "weighted_grpo" and algo.cfg.loss == "ppo_clip"


def test_weighted_grpo_without_pairing_is_refused():
    cfg = dataclasses.replace(Config(), algorithm=algo_cfg())
    with pytest.raises(ConfigError, match=r"algorithm\.advantage=weighted_grpo.*task\.pairing=true"):
        check_whole_config(cfg)  # what train() runs first, for this Config built in code
    assert PromptPairing.create(dataclasses.replace(paired_cfg(), algorithm=algo_cfg())) is not None


def test_roles_come_from_the_pairs_fresh_and_resumed():
    cfg = dataclasses.replace(paired_cfg(), algorithm=algo_cfg(weighted_grpo_neg_weight=2.0))
    c = fake_components()
    c.algo = resolve_algorithm(cfg.algorithm)
    pairing = PromptPairing.create(cfg)
    pairing.prepare(c, 0)  # pre-pass on the fake backend: the pair (q+ = row 1, q− = row 2)
    fn = c.algo.advantage_inputs["group_role"]
    assert pairing.sampler.next(2) == [1, 2]
    rollout = SimpleNamespace(group_index=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert fn(rollout).tolist() == [1, 1, 1, -1, -1, -1]
    with pytest.raises(RuntimeError, match="cannot tell q\\+ from q−"):
        fn(SimpleNamespace(group_index=torch.tensor([0, 1, 2])))
    # A resumed run: the pairs come back from the sampler's state; the roles are the same.
    state = pairing.sampler.state_dict()
    c2 = fake_components()
    c2.algo = resolve_algorithm(cfg.algorithm)
    resumed = PromptPairing.create(cfg)
    resumed.sampler.load_state_dict(state)
    resumed.prepare(c2, 7)
    assert c2.backend.calls == []  # nothing re-estimated
    assert resumed.sampler.next(2) == pairing.sampler.next(2)
    assert c2.algo.advantage_inputs["group_role"](rollout).tolist() == [1, 1, 1, -1, -1, -1]
    # Other estimators get no role input.
    c3 = fake_components()
    c3.algo = resolve_algorithm(AlgorithmConfig())
    PromptPairing.create(paired_cfg()).prepare(c3, 0)
    assert c3.algo.advantage_inputs == {}


def test_paired_run_with_weighted_grpo(tiny_model_dir, write_jsonl, tmp_path):
    res = pairing_run(tiny_model_dir, rate_task(write_jsonl), tmp_path,
                      **{"algorithm.name": "weighted_grpo", "algorithm.weighted_grpo_neg_weight": 3.0})
    assert len(res.history) == 3
    for m in res.history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["advantage/mean"])
        assert 0 <= m["pairing/qplus_accuracy"] <= 1 and 0 <= m["pairing/qminus_accuracy"] <= 1


def test_weighted_grpo_without_pairing_is_refused_when_the_config_loads():
    """Before any model loads (config_loading.validate), not at the pairing pre-pass."""
    from anabranch import load_config

    with pytest.raises(ConfigError, match=r"algorithm\.advantage=weighted_grpo.*task\.pairing=true"):
        load_config(None, ["algorithm.name=weighted_grpo"])
    assert load_config(None, ["algorithm.name=weighted_grpo", "task.pairing=true"]).algorithm.advantage == NAME_WG


NAME_WG = "weighted_grpo"
