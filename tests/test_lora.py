"""LoRA through peft with the tiny model: only adapters train, the reference is the base model with
adapters disabled (no second copy), and the export is plain Hugging Face weights."""

import subprocess
import sys

import torch

from anabranch import load_config
from anabranch.algorithms import resolve_algorithm
from anabranch.models.logprobs import response_forward
from anabranch.models.lora import AdapterDisabledReference, merged_state_dict
from anabranch.trainer.checkpoint import export_hf
from anabranch.trainer.components import build
from anabranch.trainer.step import no_grad_log_probs, policy_update
from test_distributed import R, fixed_rollout


def lora_components(model_dir, write_jsonl, **extra):
    data = write_jsonl([{"prompt": f"Q{i}", "answer": "7"} for i in range(8)])
    overrides = {"model.path": model_dir, "task.name": "file", "task.path": data, "task.eval_size": 2,
                 "model.lora.r": 4, "model.lora.alpha": 8, "algorithm.kl_coef": 0.1,
                 "trainer.device": "cpu", "trainer.lr": 5e-2, **extra}
    return build(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))


def update(c, steps=2):
    rollout, rewards = fixed_rollout([0, 1, 2, 3])
    adv = c.algo.advantage(rewards, rollout.group_index, rollout.response_mask.float(), c.algo.cfg)
    for _ in range(steps):
        metrics = policy_update(c.model, c.optimizer, rollout, adv, rewards, c.algo, micro_batch_size=8,
                                grad_clip=1.0, temperature=1.0, max_response_len=R, ref_model=c.ref_model)
    return rollout, metrics


def test_only_adapters_train_and_reference_is_the_base(tiny_model_dir, write_jsonl):
    from transformers import AutoModelForCausalLM

    c = lora_components(tiny_model_dir, write_jsonl)
    assert isinstance(c.ref_model, AdapterDisabledReference) and c.ref_model.model is c.model  # no copy
    trainable = {n for n, p in c.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in c.model.named_parameters()}
    rollout, metrics = update(c)
    changed = {n for n, p in c.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable  # B starts at 0, so only LoRA weights can move
    assert any(".lora_B." in n for n in changed)
    assert metrics["kl_ref"] > 0  # the policy moved away from the reference

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ref_lp = no_grad_log_probs(c.ref_model, rollout, 8, 1.0)
    base_lp = no_grad_log_probs(base, rollout, 8, 1.0)
    policy_lp = no_grad_log_probs(c.model, rollout, 8, 1.0)
    torch.testing.assert_close(ref_lp, base_lp, rtol=0, atol=1e-5)
    assert (policy_lp - base_lp).abs().max() > 1e-3  # adapters are back on after the reference pass


def test_export_is_plain_hf_with_merged_adapters(tiny_model_dir, write_jsonl, tmp_path):
    c = lora_components(tiny_model_dir, write_jsonl, **{"algorithm.kl_coef": 0})
    rollout, _ = update(c)
    path = export_hf(c.model, c.tokenizer, tmp_path / "final")
    assert not (path / "adapter_config.json").exists()
    code = ("import sys; sys.modules['peft'] = None; sys.modules['anabranch'] = None\n"
            "from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(path)!r})\n"
            "print(type(m).__name__, sum('lora' in n for n, _ in m.named_parameters()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LlamaForCausalLM", "0"]

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = rollout.input_ids, rollout.attention_mask
    with torch.no_grad():
        want = response_forward(c.model, ids, mask, R).log_probs
        got = response_forward(exported, ids, mask, R).log_probs
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # The weights a rollout engine would load after each update: the same merged weights, no copy.
    merged = merged_state_dict(c.model)
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6)
    assert c.model.peft_config  # exporting did not unwrap the training model


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir, write_jsonl):
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        c = lora_components(tiny_model_dir, write_jsonl, **{"model.gradient_checkpointing": ckpt,
                                                            "algorithm.kl_coef": 0})
        assert c.model.is_gradient_checkpointing == ckpt
        update(c, steps=1)
        grads.append({n: p.grad.clone() for n, p in c.model.named_parameters() if p.grad is not None})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_unknown_target_modules_name_the_key_and_the_layers(tiny_model_dir, write_jsonl):
    import pytest

    from anabranch.config import ConfigError

    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules.*\['nonexistent'\].*'q_proj'"):
        lora_components(tiny_model_dir, write_jsonl, **{"model.lora.target_modules": "[q_proj,nonexistent]"})
    c = lora_components(tiny_model_dir, write_jsonl, **{"model.lora.target_modules": "[q_proj,v_proj]"})
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, p in c.model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
