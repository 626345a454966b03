"""LoRA combined with a KL reference: the reference is the base model reached by switching the
adapters off (no second copy), computed through the same lean log-prob path as the policy, so at
the start of a run the KL term is exactly zero and has exactly zero gradient."""

import pytest
import torch

from anabranch import load_config, train
from anabranch.models.lora import AdapterDisabledReference
from anabranch.trainer.advantage_pass import rollout_forward
from anabranch.trainer.components import build
from test_distributed import fixed_rollout
from test_train_e2e import digit_task, tiny_overrides


def zero_reward(prompts, completions, **_):
    return [0.0] * len(completions)


def test_reference_log_probs_equal_the_policy_bitwise_at_the_start(tiny_model_dir, write_jsonl, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "model.lora.r": 4, "algorithm.kl_coef": 0.1}))
    c = build(cfg)
    assert isinstance(c.ref_model, AdapterDisabledReference) and c.ref_model.model is c.model  # no copy
    rollout, _ = fixed_rollout([0, 1, 2, 3])
    for share in (False, True):  # the reference takes the shared prompt prefix where the policy does
        policy, _ = rollout_forward(c.model, rollout, 8, 1.0, share_prefix=share)
        ref, _ = rollout_forward(c.ref_model, rollout, 8, 1.0, share_prefix=share)
        assert torch.equal(policy, ref), share  # B = 0: the same model through the same kernels


@pytest.mark.parametrize("share", ["false", "true"])
def test_kl_alone_leaves_the_adapters_at_zero(tiny_model_dir, write_jsonl, tmp_path, share):
    """All rewards 0: the advantages are 0 and the KL to the adapter-free reference is 0 with a zero
    gradient, so Adam must not move the adapters (a rounding-noise gradient would be normalized by
    Adam into lr-sized steps). With or without the shared prompt prefix, the policy's update and the
    reference run the same kernels."""
    captured = {}
    import anabranch.trainer.loop as loop

    real_build = loop.build

    def spy(cfg, **kw):
        captured["c"] = real_build(cfg, **kw)
        return captured["c"]

    loop.build = spy
    try:
        cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
            "model.lora.r": 4, "algorithm.kl_coef": 0.1, "trainer.steps": 2, "task.eval_size": 0,
            "rollout.n": 4, "rollout.prompts_per_step": 2, "trainer.save_final": "false",
            "reward.functions": "[test_combinations_lora:zero_reward]", "reward.isolation": "none",
            "trainer.share_prompt_prefix": share}))
        result = train(cfg)
    finally:
        loop.build = real_build
    assert [m["kl_ref"] for m in result.history] == [0.0, 0.0]
    lora_b = [p for n, p in captured["c"].model.named_parameters() if ".lora_B." in n]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)
