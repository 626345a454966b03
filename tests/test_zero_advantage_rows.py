"""Sequences with Â = 0 everywhere: the update's gradient and metrics are those of a full forward and
backward over every sequence, with less computed (trainer/inert_rows.py)."""

import pytest
import torch

import anabranch.trainer.step as step_mod
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, ModelConfig
from anabranch.config_loading import load_config
from anabranch.models.loading import load_model
from anabranch.trainer.inert_rows import inert_rows
from anabranch.trainer.step import policy_update

from test_dapo_batch import fake_rollout

# Group 0 all right, group 1 mixed, group 2 all wrong: GRPO's Â is 0 on groups 0 and 2.
REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def _rollout():
    torch.manual_seed(0)
    r = fake_rollout(3, 3, 3, 5)
    r.prompt_ids = torch.randint(3, 60, r.prompt_ids.shape)
    r.prompt_ids[3:6] = r.prompt_ids[3]  # one prompt per group, so the shared-prefix path is taken
    r.prompt_ids[6:] = r.prompt_ids[6]
    r.prompt_ids[:3] = r.prompt_ids[0]
    r.response_ids = torch.randint(3, 60, r.response_ids.shape)
    r.response_mask[4, 3:] = 0
    r.response_mask[7, 2:] = 0
    return r


def _model(model_dir):
    model = load_model(ModelConfig(path=model_dir), torch.device("cpu"), trainable=True)
    with torch.no_grad():  # sharper logits than the random init's, so entropies differ between rows
        model.model.norm.weight.mul_(4.0)
    return model


def _update(model_dir, mode, algo, rollout, rewards, **kw):
    model = _model(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adv = algo.advantage(rewards, rollout.group_index, rollout.response_mask.float(), algo.cfg)
    metrics = policy_update(model, opt, rollout, adv, rewards, algo, micro_batch_size=4, grad_clip=0.0,
                            temperature=1.0, max_response_len=5, zero_advantage_rows=mode, **kw)
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return grad, weights, metrics


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("tokens", [0, 24])
def test_same_gradient_and_metrics_as_training_every_sequence(tiny_model_dir, name, tokens):
    ro, algo = _rollout(), resolve_algorithm(AlgorithmConfig(name=name))
    g_train, _, m_train = _update(tiny_model_dir, "train", algo, ro, REWARDS, micro_batch_tokens=tokens)
    g_fwd, _, m_fwd = _update(tiny_model_dir, "forward", algo, ro, REWARDS, micro_batch_tokens=tokens)
    g_skip, _, m_skip = _update(tiny_model_dir, "skip", algo, ro, REWARDS, micro_batch_tokens=tokens)
    assert g_train.abs().sum() > 0
    torch.testing.assert_close(g_fwd, g_train, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(g_skip, g_train, rtol=1e-4, atol=1e-7)
    assert m_fwd["loss"] == pytest.approx(m_train["loss"], abs=1e-6)
    assert m_skip["loss"] == pytest.approx(m_train["loss"], abs=1e-6)
    # `forward` keeps the whole batch's metrics; `skip` has them over group 1 only.
    for key in ("entropy", "approx_kl", "cov/entropy_adv", "cov/logp_adv"):
        assert m_fwd[key] == pytest.approx(m_train[key], rel=1e-4, abs=1e-6), key
    assert abs(m_skip["entropy"] - m_train["entropy"]) > 0.05
    assert m_fwd["update/zero_advantage_frac"] == pytest.approx(6 / 9)
    assert "update/zero_advantage_frac" not in m_train


def test_skip_reports_the_entropy_of_the_trained_sequences(tiny_model_dir):
    ro, algo = _rollout(), resolve_algorithm(AlgorithmConfig(name="grpo"))
    # Only group 1 with rewards, so its entropy alone is what `train` reports for that rollout.
    only = fake_rollout(1, 3, 3, 5)
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        setattr(only, key, getattr(ro, key)[3:6].clone())
    _, _, m_only = _update(tiny_model_dir, "train", algo, only, REWARDS[3:6])
    _, _, m_skip = _update(tiny_model_dir, "skip", algo, ro, REWARDS)
    assert m_skip["entropy"] == pytest.approx(m_only["entropy"], rel=1e-4)
    assert abs(m_skip["entropy"] - _update(tiny_model_dir, "train", algo, ro, REWARDS)[2]["entropy"]) > 0.05


def test_what_each_mode_runs(tiny_model_dir, monkeypatch):
    """`forward`: the zero-advantage rows without autograd; `skip`: not at all; `train`: all with it."""
    seen = []
    real = step_mod.forward_micro_batch

    def spy(model, mb, *args, **kw):
        seen.append((mb.rows.tolist(), torch.is_grad_enabled()))
        return real(model, mb, *args, **kw)

    monkeypatch.setattr(step_mod, "forward_micro_batch", spy)
    ro, algo = _rollout(), resolve_algorithm(AlgorithmConfig(name="grpo"))
    runs = {}
    for mode in ("train", "forward", "skip"):
        seen.clear()
        _update(tiny_model_dir, mode, algo, ro, REWARDS)
        runs[mode] = {row: grad for rows, grad in seen for row in rows}
    assert runs["train"] == {i: True for i in range(9)}
    assert runs["forward"] == {**{i: False for i in (0, 1, 2, 6, 7, 8)}, **{i: True for i in (3, 4, 5)}}
    assert runs["skip"] == {i: True for i in (3, 4, 5)}


def test_a_batch_without_gradient_still_steps_adam_as_before(tiny_model_dir):
    """Every group uniform: no backward runs, yet Adam's step on the zero gradient (its momentum from
    the step before still moves the weights) is the one a full backward would have given."""
    ro, algo = _rollout(), resolve_algorithm(AlgorithmConfig(name="grpo"))
    mixed = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    uniform = torch.tensor([1.0] * 3 + [0.0] * 6)
    out = {}
    for mode in ("train", "forward", "skip"):
        model = _model(tiny_model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for rewards in (mixed, uniform):
            adv = algo.advantage(rewards, ro.group_index, ro.response_mask.float(), algo.cfg)
            m = policy_update(model, opt, ro, adv, rewards, algo, micro_batch_size=4, grad_clip=1.0,
                              temperature=1.0, max_response_len=5, zero_advantage_rows=mode)
        out[mode] = (torch.cat([p.detach().flatten() for p in model.parameters()]), m)
    assert out["forward"][1]["update/zero_advantage_frac"] == 1.0
    assert out["forward"][1]["grad_norm"] == 0.0 and out["forward"][1]["skipped_updates"] == 0.0
    torch.testing.assert_close(out["forward"][0], out["train"][0], rtol=0, atol=1e-7)
    torch.testing.assert_close(out["skip"][0], out["train"][0], rtol=0, atol=1e-7)
    assert "entropy" in out["forward"][1] and "entropy" not in out["skip"][1]


@pytest.mark.parametrize("cfg,kl,why", [
    (dict(name="grpo", kl_coef=0.1), 0.1, "a KL term in the loss"),
    (dict(name="grpo", entropy_coef=0.01), 0.0, "an entropy bonus"),
    (dict(name="grpo", entropy_top_rho=0.2), 0.0, "a batch-wide token selection"),
    (dict(name="clip_cov"), 0.0, "a batch-wide token selection"),
    (dict(name="kl_cov"), 0.0, "a batch-wide token selection"),
    (dict(name="flowrl"), 0.0, "a loss that is not linear in Â"),
    (dict(name="ppo"), 0.0, "a critic loss"),
])
def test_not_used_where_the_zero_is_not_exact(cfg, kl, why):
    algo = resolve_algorithm(AlgorithmConfig(**cfg))
    adv, mask = torch.zeros(2, 3), torch.ones(2, 3)
    assert inert_rows(algo, adv, mask, kl, "forward", distributed=False) is None, why


def test_which_rows_are_inert():
    algo = resolve_algorithm(AlgorithmConfig(name="grpo", kl_coef=0.1, kl_in="reward"))
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1e-12, 0.0], [2.0, 2.0, 2.0], [float("nan"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 1]])
    # KL in the reward is part of Â; a tiny advantage still has a gradient; an empty mask has no loss.
    assert inert_rows(algo, adv, mask, 0.1, "skip", distributed=False).tolist() == [True, False, True, False]
    assert inert_rows(algo, adv, mask, 0.1, "train", distributed=False) is None
    assert inert_rows(algo, adv, mask, 0.1, "forward", distributed=True) is None


def test_the_setting_is_checked():
    with pytest.raises(ConfigError, match="trainer.zero_advantage_rows"):
        load_config(None, ["trainer.zero_advantage_rows=never"])


@pytest.mark.parametrize("mode", ["train", "skip"])
def test_the_trainer_passes_the_setting_to_the_update(tiny_model_dir, write_jsonl, tmp_path, mode):
    from anabranch import train
    from test_train_e2e import digit_task, tiny_overrides

    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl, 8), tmp_path,
                                           **{"trainer.steps": 2, "trainer.eval_before": False,
                                              "trainer.eval_after": False, "trainer.save_final": False,
                                              "trainer.zero_advantage_rows": mode}))
    history = train(cfg).history
    assert len(history) == 2
    assert all(("update/zero_advantage_frac" in m) == (mode == "skip") for m in history)
