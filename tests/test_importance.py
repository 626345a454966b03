"""Sampler/trainer mismatch metrics and truncated importance sampling, against hand-computed values."""

import math

import pytest
import torch

from anabranch.rollout.importance import mismatch_metrics, sampler_correction


def test_mismatch_metrics_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    sampler = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = mismatch_metrics(trainer, sampler, mask)
    assert m["mismatch/kl"] == pytest.approx((-0.5 + 1.0) / 2)
    assert m["mismatch/abs_mean"] == pytest.approx((0.5 + 1.0) / 2)


def test_tis_scales_advantages_by_truncated_ratio():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -2.0, -0.5]])  # ratios e^0, e^1, e^-0.5
    adv = torch.tensor([[2.0, 2.0, -2.0]])
    mask = torch.ones(1, 3)
    out, metrics = sampler_correction(old, sampler, mask, adv, cap=2.0)
    expected = torch.tensor([[2.0 * 1.0, 2.0 * 2.0, -2.0 * math.exp(-0.5)]])  # e^1 = 2.718 → capped at 2
    assert torch.allclose(out, expected)
    assert metrics["mismatch/tis_clipped_frac"] == pytest.approx(1 / 3)
    # cap 0: advantages untouched, mismatch still reported; no sampler log-probs: nothing at all.
    same, m0 = sampler_correction(old, sampler, mask, adv, cap=0.0)
    assert torch.equal(same, adv) and "mismatch/kl" in m0 and "mismatch/tis_weight_mean" not in m0
    assert sampler_correction(old, None, mask, adv, cap=2.0) == (adv, {})


def test_vllm_backend_without_vllm_names_the_extra(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anabranch.config import ConfigError, RolloutConfig
    from anabranch.rollout import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"anabranch\[vllm\]"):
        vllm_backend.VLLMBackend(model, AutoTokenizer.from_pretrained(tiny_model_dir), RolloutConfig(backend="vllm"))
