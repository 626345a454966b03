"""Combinations of settings that were accepted and then silently did nothing useful, or only
approximately what the docs say: refused with a ConfigError naming the keys, or warned at start."""

import dataclasses

import pytest

from anabranch import load_config
from anabranch.algorithms import resolve_algorithm
from anabranch.config import ConfigError
from anabranch.trainer.components import build
from test_train_e2e import digit_task, tiny_overrides


def test_adaptive_kl_needs_an_initial_coefficient():
    # β ← β·(1 + e·n/horizon) from β = 0 stays 0, and kl_coef = 0 loads no reference at all.
    with pytest.raises(ConfigError, match=r"algorithm\.kl_target needs algorithm\.kl_coef > 0") as err:
        load_config(None, ["algorithm.kl_target=0.01"])  # refused at load (config_checks runs check_ranges)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"algorithm\.kl_target needs algorithm\.kl_coef > 0"):
        resolve_algorithm(dataclasses.replace(load_config().algorithm, kl_target=0.01))  # and at resolution
    algo = resolve_algorithm(load_config(None, ["algorithm.kl_target=0.01", "algorithm.kl_coef=0.05"]).algorithm)
    assert "ref_log_prob" in algo.needs


@pytest.mark.parametrize("overrides", [["rollout.temperature=0"], ["rollout.temperature=0", "algorithm.name=flowrl"]])
def test_greedy_rollouts_of_several_samples_are_refused(overrides):
    with pytest.raises(ConfigError, match=r"rollout\.temperature.*identical.*rollout\.n=1"):
        load_config(None, overrides)


def test_greedy_rollouts_of_one_sample_are_accepted():
    assert load_config(None, ["rollout.temperature=0", "rollout.n=1", "algorithm.name=reinforce_pp"]).rollout.n == 1


@pytest.mark.parametrize("overrides", [["algorithm.name=dapo", "rollout.n=1"],
                                       ["algorithm.dynamic_sampling=true", "rollout.n=1",
                                        "algorithm.advantage=reinforce_pp", "algorithm.loss=ppo_clip"]])
def test_dynamic_sampling_needs_groups_of_two(overrides):
    # A group of one never has differing rewards: every round would be dropped.
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling' needs rollout\.n >= 2"):
        load_config(None, overrides)
    assert load_config(None, ["algorithm.name=dapo", "rollout.n=2"]).algorithm.dynamic_sampling


@pytest.mark.parametrize("extra, warned", [
    ({"algorithm.entropy_top_rho": 0.2, "trainer.micro_batch_size": 4, "trainer.micro_batch_tokens": 0}, True),
    ({"algorithm.name": "clip_cov", "trainer.micro_batch_tokens": 40}, True),
    ({"algorithm.name": "kl_cov", "trainer.micro_batch_size": 8, "trainer.micro_batch_tokens": 0}, True),
    # One micro-batch holds the step's 32 sequences: the selection is the batch-wide one.
    ({"algorithm.entropy_top_rho": 0.2, "trainer.micro_batch_size": 32, "trainer.micro_batch_tokens": 0}, False),
    ({"algorithm.name": "clip_cov", "trainer.micro_batch_tokens": 100000}, False),
    # Token-wise controls are exact under any micro-batching.
    ({"algorithm.entropy_adv_alpha": 0.4, "algorithm.entropy_coef": 0.01, "trainer.micro_batch_size": 4,
      "trainer.micro_batch_tokens": 0}, False),
])
def test_per_micro_batch_token_selection_is_warned(tiny_model_dir, write_jsonl, tmp_path, capsys, extra, warned):
    build(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **extra)))
    out = capsys.readouterr().out
    assert ("select tokens within each micro-batch" in out or "selects tokens within each micro-batch" in out) \
        == warned, out
    if warned:
        assert "trainer.micro_batch_tokens=0 trainer.micro_batch_size=32" in out


@pytest.mark.parametrize("extra, warned", [({"model.dtype": "bfloat16"}, True), ({"model.dtype": "float16"}, True),
                                           ({"model.dtype": "bfloat16", "model.lora.r": 4}, False),
                                           ({}, False)])
def test_low_precision_full_fine_tuning_is_warned(tiny_model_dir, write_jsonl, tmp_path, capsys, extra, warned):
    build(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                                           **{"trainer.lr": 2e-5, **extra})))
    out = capsys.readouterr().out
    assert ("no fp32 master copy" in out) == warned, out
    if warned:
        assert f"model.dtype={extra['model.dtype']}" in out


def test_vargrad_log_z_leaves_out_responses_the_overlong_filter_emptied():
    """VarGrad's log Z is the group mean of ζ over the samples in the loss: a row the overlong filter
    emptied (ζ = 0 there) must not shift it, so FlowRL takes overlong_filter=true with any log Z."""
    from functools import partial

    import torch

    from anabranch.algorithms.aggregation import BatchScale, aggregate
    from anabranch.algorithms.flowrl import flowrl_loss
    from anabranch.trainer.step import LossContext

    cfg = load_config(None, ["algorithm.name=flowrl", "algorithm.flowrl.log_z=vargrad",
                             "algorithm.flowrl.reference=none"]).algorithm
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.5, 0.5]])

    def run(rows, mask):
        scale = BatchScale(total_tokens=float(mask.sum()), total_seqs=2.0, max_response_len=2)
        ctx = LossContext(cfg=cfg, aggregate=partial(aggregate, mode=cfg.loss_agg_mode, scale=scale),
                          group_index=torch.zeros(len(rows), dtype=torch.long))
        return flowrl_loss(lp[rows], lp[rows], adv[rows], mask, ctx)

    filtered = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # the third response was filtered out
    (loss_f, m_f), (loss_2, m_2) = run([0, 1, 2], filtered), run([0, 1], torch.ones(2, 2))
    assert m_f["flowrl/log_z_mean"] == pytest.approx(m_2["flowrl/log_z_mean"])
    assert float(loss_f) == pytest.approx(float(loss_2))
    # ζ = β·r̂ − log π (reference none): the two kept rows' mean, by hand.
    beta = cfg.flowrl.beta
    zeta = [beta * 1.0 + 1.5, beta * -1.0 + 0.5]
    assert m_2["flowrl/log_z_mean"] == pytest.approx(sum(zeta) / 2)
    for ok in (["algorithm.name=flowrl", "algorithm.overlong_filter=true"],
               ["algorithm.name=flowrl", "algorithm.flowrl.log_z=vargrad", "algorithm.overlong_filter=true"]):
        resolve_algorithm(load_config(None, ok).algorithm)


def test_per_process_token_selection_is_warned(tiny_model_dir, write_jsonl, tmp_path, capsys, monkeypatch):
    # Under data parallelism each process selects within its own share, whatever the micro-batches.
    monkeypatch.setenv("WORLD_SIZE", "2")
    from anabranch.trainer import components

    c = build(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "algorithm.entropy_top_rho": 0.2, "trainer.micro_batch_size": 32, "trainer.micro_batch_tokens": 0})))
    text = components.warn_per_micro_batch_selection(c.cfg, c.algo, c.model, c.device, 20)
    assert text and "2 data-parallel processes" in text and "one process" in text


@pytest.mark.parametrize("backend,warned", [("hf", True), ("vllm", False)])
def test_tis_without_an_inference_engine_is_warned(backend, warned, capsys):
    from anabranch.trainer.components import warn_unused_tis

    cfg = load_config(None, ["algorithm.tis_cap=2", f"rollout.backend={backend}"])
    assert (warn_unused_tis(cfg) is not None) == warned
    assert ("tis_cap=2 has no effect with rollout.backend=hf" in capsys.readouterr().out) == warned
    assert warn_unused_tis(load_config(None, ["rollout.backend=hf"])) is None  # tis_cap off: nothing to say
