"""ALP (Ye et al. 2026, arXiv 2603.19470): the layer noise against its seeded draws and N(0, σ²) statistics,
the hooks active only in the update's forward (π_old, reference-style passes and generation unperturbed), the
ratio's numerator perturbed by exactly the hand-computed forward, σ's gradient against finite differences,
σ learned and kept in checkpoints, the refusals, and a short run on the tiny model."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from anabranch import load_config, train
from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.alp import LayerNoiseScales, layer_noise, pass_seed
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.config_algorithm_options import ALPConfig
from anabranch.rollout.base import Rollout
from anabranch.trainer.checkpoint import load_module_states, module_states
from anabranch.trainer.microbatch import forward_micro_batch, plan_micro_batches
from anabranch.trainer.step import no_grad_log_probs, policy_update
from test_train_e2e import digit_task, tiny_overrides


class Recorder(nn.Module):
    """A stand-in decoder layer: returns its input and keeps a copy of it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, hidden_states, scale=1.0):
        self.seen.append(hidden_states.detach().clone())
        return hidden_states * scale


class Stack(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.layers = nn.ModuleList(Recorder() for _ in range(n))

    def forward(self, x, as_kwarg=False):
        for layer in self.layers:
            x = layer(hidden_states=x) if as_kwarg else layer(x, scale=1.0)
        return x


# ---------------------------------------------------------------- the noise by hand

def test_noise_is_sigma_times_a_seeded_standard_gaussian_per_layer():
    torch.manual_seed(0)
    stack, x = Stack(), torch.randn(2, 64, 128)
    scales = LayerNoiseScales(2, ALPConfig(enabled=True, init_std=0.3, seed=5))
    scales.attach(stack)
    stack(x)  # outside the block: no noise, and the input reaches the layer untouched
    assert torch.equal(stack.layers[0].seen[-1], x)
    with scales.perturb(stack):
        stack(x)
    seed0 = pass_seed(5, 0, 0)
    eps0 = (stack.layers[0].seen[-1] - x) / 0.3
    # The draw is the pass's seeded generator's, scaled by σ = exp(log σ) = init_std.
    torch.testing.assert_close(eps0, layer_noise(x.shape, seed0, 0, x.device), atol=1e-5, rtol=0)
    # N(0, 1) per element: 16 384 draws, so the mean's standard error is 0.008 and the std's 0.006.
    assert abs(eps0.mean().item()) < 0.03 and abs(eps0.std().item() - 1.0) < 0.03
    # Layer 1 sees layer 0's output (its perturbed input x + σε₀) plus its own, independent draw.
    eps1 = (stack.layers[1].seen[-1] - stack.layers[0].seen[-1]) / 0.3
    assert abs(eps1.std().item() - 1.0) < 0.03
    assert abs(torch.corrcoef(torch.stack([eps0.flatten(), eps1.flatten()]))[0, 1].item()) < 0.03
    # The pass counter moves: the next pass draws new noise; a fresh module with the same seed repeats pass 0.
    assert int(scales.passes) == 1
    with scales.perturb(stack):
        stack(x)
    assert not torch.allclose(stack.layers[0].seen[-1], stack.layers[0].seen[1])
    again = LayerNoiseScales(2, ALPConfig(enabled=True, init_std=0.3, seed=5))
    other = Stack()
    again.attach(other)
    with again.perturb(other):
        other(x, as_kwarg=True)  # hidden_states passed by keyword is perturbed the same way
    assert torch.equal(other.layers[0].seen[-1], stack.layers[0].seen[1])


def test_layer_range_and_fixed_sigma():
    stack, x = Stack(3), torch.randn(2, 8, 16)
    scales = LayerNoiseScales(3, ALPConfig(enabled=True, init_std=0.1, learnable=False, start_layer=1, end_layer=2))
    assert scales.layers == [1] and list(scales.parameters()) == []  # fixed σ: a buffer, not trained
    scales.attach(stack)
    with scales.perturb(stack):
        stack(x)
    assert torch.equal(stack.layers[1].seen[-1], x) is False
    assert torch.equal(stack.layers[0].seen[-1], x)  # layer 0 is before the range
    torch.testing.assert_close(stack.layers[2].seen[-1], stack.layers[1].seen[-1])  # layer 2 is past it
    with pytest.raises(ConfigError, match="past the model"):
        LayerNoiseScales(2, ALPConfig(enabled=True, start_layer=2))


# ---------------------------------------------------------------- on the tiny model

def tiny_rollout(vocab: int, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (4, 5), generator=g)
    response_ids = torch.randint(3, vocab, (4, 6), generator=g)
    response_mask = torch.ones(4, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    return Rollout(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), response_ids=response_ids,
                   response_mask=response_mask, group_index=torch.tensor([0, 0, 1, 1]), prompts=["a", "b"],
                   completions=[""] * 4, truncated=torch.zeros(4, dtype=torch.bool))


def tiny_policy(tiny_model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).train()


ADV = torch.tensor([[1.0] * 6, [-1.0] * 6, [0.5] * 6, [-0.5] * 6])


def alp_algo(**k):
    return resolve_algorithm(AlgorithmConfig(alp=ALPConfig(enabled=True, **k)))


def test_resolution_forces_an_unperturbed_old_forward_and_adds_the_scales():
    algo = alp_algo(init_std=0.2)
    assert "old_log_prob" in algo.needs and set(algo.module_factories) == {"alp"}
    off = resolve_algorithm(AlgorithmConfig())
    assert "old_log_prob" not in off.needs and "alp" not in off.module_factories  # off: nothing added


def test_only_the_update_forward_is_perturbed(tiny_model_dir):
    model = tiny_policy(tiny_model_dir)
    clean = tiny_policy(tiny_model_dir)  # a copy that never gets hooks: the reference's view
    rollout = tiny_rollout(model.config.vocab_size)
    algo = alp_algo(init_std=0.5, seed=3)
    scales = algo.module_factories["alp"](model.config, algo.cfg)
    before = no_grad_log_probs(model, rollout, 4, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: only the passes are compared
    out = policy_update(model, opt, rollout, ADV, torch.zeros(4), algo, micro_batch_size=4, grad_clip=0.0,
                        temperature=1.0, max_response_len=6, modules={"alp": scales},
                        precomputed={"old_log_prob": before})
    # By hand: the same pass (seed 3, rank 0, pass 0) of a fresh copy of the scales, on the update's forward.
    twin = algo.module_factories["alp"](model.config, algo.cfg)
    mb = plan_micro_batches(rollout.prompt_mask, rollout.response_mask, 4)[0]
    with twin.perturb(clean):
        noisy = forward_micro_batch(clean, mb, rollout.input_ids, rollout.attention_mask, 1.0).log_probs.detach()
    mask = rollout.trained_mask.float()
    want_kl = masked_mean(before - noisy, mask).item()
    assert abs(want_kl) > 1e-3  # the numerator is perturbed: the ratio is not 1 on a first pass
    assert out["approx_kl"] == pytest.approx(want_kl, rel=1e-4, abs=1e-7)
    assert out["alp/sigma_mean"] == pytest.approx(0.5)
    assert int(scales.passes) == 1
    # Outside the update every pass is the clean model's: π_old / reference recomputes, and generation.
    after = no_grad_log_probs(model, rollout, 4, 1.0)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    torch.testing.assert_close(after, no_grad_log_probs(clean, rollout, 4, 1.0), atol=1e-6, rtol=0)
    prompt = rollout.prompt_ids[:1]
    with torch.no_grad():
        gen = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        gen_clean = clean.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, gen_clean)


def test_sigma_gradient_matches_finite_differences(tiny_model_dir):
    """d/ds_l of the clipped surrogate −Â·π_{θ,δ}/π_old (within the clip range), δ held fixed by the seed."""
    model = tiny_policy(tiny_model_dir, torch.float64)
    rollout = tiny_rollout(model.config.vocab_size, seed=1)
    cfg = ALPConfig(enabled=True, init_std=0.05, seed=11)
    mask = rollout.trained_mask.double()
    P = rollout.prompt_ids.shape[1]

    def response_log_probs():  # the plain model call in float64 (the trainer's head pass computes in float32)
        logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits[:, P - 1:-1]
        return torch.log_softmax(logits, -1).gather(-1, rollout.response_ids[..., None])[..., 0]

    with torch.no_grad():
        old = response_log_probs()

    def surrogate(log_sigma: torch.Tensor) -> torch.Tensor:
        scales = LayerNoiseScales(2, cfg).double()
        with torch.no_grad():
            scales.log_sigma.copy_(log_sigma)
        with scales.perturb(model):  # a fresh module: always pass 0, so always the same δ
            lp = response_log_probs()
            loss = (-ADV.double() * torch.exp(lp - old) * mask).sum() / mask.sum()
            if log_sigma.requires_grad:
                loss.backward()
                return scales.log_sigma.grad.clone()
        return loss.detach()

    s0 = torch.full((2,), math.log(0.05), dtype=torch.float64)
    grad = surrogate(s0.clone().requires_grad_(True))
    assert grad.abs().min() > 1e-6  # σ has a gradient from the policy loss alone
    h = 1e-3  # RoPE's float32 cos/sin leave ~1e-8 of noise in the loss: a smaller step would amplify it
    for layer in range(2):
        e = torch.zeros(2, dtype=torch.float64)
        e[layer] = h
        fd = (surrogate(s0 + e) - surrogate(s0 - e)) / (2 * h)
        assert grad[layer].item() == pytest.approx(fd.item(), rel=1e-3)


def test_gradient_checkpointing_recomputes_the_same_noise(tiny_model_dir):
    """The backward's recompute of a checkpointed layer runs the hook again: it must draw the same δ."""
    rollout = tiny_rollout(64, seed=3)
    cfg = ALPConfig(enabled=True, init_std=0.2, seed=4)

    def grads(checkpointing: bool):
        model = tiny_policy(tiny_model_dir)
        if checkpointing:
            model.gradient_checkpointing_enable()
        scales = LayerNoiseScales(2, cfg)
        with scales.perturb(model):
            logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
            (logits[:, -6:].log_softmax(-1).gather(-1, rollout.response_ids[..., None]) * ADV[..., None]).sum().backward()
        return scales.log_sigma.grad, model.model.embed_tokens.weight.grad

    (s_plain, e_plain), (s_ckpt, e_ckpt) = grads(False), grads(True)
    torch.testing.assert_close(s_ckpt, s_plain, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(e_ckpt, e_plain, rtol=1e-4, atol=1e-7)


def test_sigma_is_learned_and_restored_from_a_checkpoint(tiny_model_dir):
    model = tiny_policy(tiny_model_dir)
    rollout = tiny_rollout(model.config.vocab_size, seed=2)
    algo = alp_algo(init_std=0.3, lr_multiplier=10.0)
    scales = algo.module_factories["alp"](model.config, algo.cfg)
    assert scales.lr_multiplier == 10.0 and [p.shape for p in scales.parameters()] == [torch.Size([2])]
    opt = torch.optim.Adam([{"params": model.parameters(), "lr": 1e-3},
                            {"params": scales.parameters(), "lr": 1e-2}])
    old = no_grad_log_probs(model, rollout, 4, 1.0)
    policy_update(model, opt, rollout, ADV, torch.zeros(4), algo, micro_batch_size=2, grad_clip=1.0,
                  temperature=1.0, max_response_len=6, modules={"alp": scales}, precomputed={"old_log_prob": old})
    # Adam's first step moves each coordinate by lr in the direction of −sign(gradient).
    moved = scales.log_sigma.detach() - math.log(0.3)
    torch.testing.assert_close(moved.abs(), torch.full((2,), 1e-2), atol=1e-5, rtol=0)
    assert int(scales.passes) == 2  # two micro-batches, each its own noise
    state = {"modules": module_states({"alp": scales})}
    fresh = algo.module_factories["alp"](model.config, algo.cfg)
    load_module_states({"alp": fresh}, state)
    assert torch.equal(fresh.log_sigma, scales.log_sigma) and int(fresh.passes) == 2
    with pytest.raises(ValueError):
        load_module_states({}, state)  # a run without ALP refuses the checkpoint's scales


# ---------------------------------------------------------------- refusals

def _load(tiny_model_dir, write_jsonl, tmp_path, **extra):
    return load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **extra))


@pytest.mark.parametrize("extra, match", [
    ({"algorithm.alp.init_std": 0.5}, "no effect unless algorithm.alp.enabled=true"),
    ({"algorithm.alp.enabled": True, "algorithm.name": "flowrl"}, "has none; use one of"),
    ({"algorithm.alp.enabled": True, "trainer.compile_layers": True}, "compile_layers=false"),
    ({"algorithm.alp.enabled": True, "algorithm.alp.init_std": 0.0}, "init_std must be a positive"),
    ({"algorithm.alp.enabled": True, "algorithm.alp.start_layer": 1, "algorithm.alp.end_layer": 1}, "are empty"),
    ({"algorithm.alp.enabled": True, "algorithm.alp.lr_multiplier": -1.0}, "lr_multiplier must be >= 0"),
])
def test_refused_at_load(tiny_model_dir, write_jsonl, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _load(tiny_model_dir, write_jsonl, tmp_path, **extra)


def test_refused_in_code_for_a_loss_without_a_ratio():
    with pytest.raises(ConfigError, match="has none"):
        resolve_algorithm(AlgorithmConfig(loss="flowrl", advantage="grpo", alp=ALPConfig(enabled=True)))


# ---------------------------------------------------------------- through the trainer

def test_tiny_run_logs_sigma_and_checkpoints_the_scales(tiny_model_dir, write_jsonl, tmp_path):
    result = train(_load(tiny_model_dir, write_jsonl, tmp_path, **{
        "algorithm.alp.enabled": True, "algorithm.alp.init_std": 0.2, "trainer.steps": 2, "trainer.save_every": 2,
        "trainer.eval_before": False, "trainer.eval_after": False, "rollout.max_new_tokens": 3}))
    for m in result.history:
        assert m["skipped_updates"] == 0
        for key in ("alp/sigma_mean", "alp/sigma_min", "alp/sigma_max", "approx_kl", "loss"):
            assert math.isfinite(m[key]), key
    state = torch.load(Path(result.run_dir) / "checkpoints" / "step-000002" / "trainer_state.pt",
                       weights_only=False, map_location="cpu")
    saved = state["modules"]["alp"]
    assert saved["log_sigma"].shape == (2,) and int(saved["passes"]) >= 2
    assert len(state["optimizer"]["param_groups"]) == 2  # the policy and σ's own group
