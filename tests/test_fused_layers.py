"""The compiled norm, MLP and rotary functions (models/fused_layers.py) give the model's own numbers,
are taken only where the math is the same, and step aside for modules that change later."""

import pytest
import torch

from anabranch.config import Config, ConfigError
from anabranch.models import fused_layers
from anabranch.trainer.components import compile_policy_layers


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    fused = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    counts = fused_layers.install(fused)
    yield plain, fused, counts
    fused_layers.uninstall(fused)
    fused_layers.restore_rotary()


def _logits_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits.log_softmax(-1)[..., 5] * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_norm_mlp_and_the_rotary_function_are_taken(models):
    plain, _, counts = models
    layers = plain.config.num_hidden_layers
    assert counts == {"rms_norm": 2 * layers + 1, "mlp": layers, "rotary": 1}


@pytest.mark.parametrize("lengths", [(7, 7), (5, 9), (12, 3)])
def test_fused_model_gives_the_same_logits_and_gradients(models, lengths):
    plain, fused, _ = models
    g = torch.Generator().manual_seed(sum(lengths))
    T = max(lengths)
    ids = torch.randint(3, plain.config.vocab_size, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] >= T - torch.tensor(lengths)[:, None]).long()  # left padding
    fused_layers.restore_rotary()  # process-wide: the plain model must run transformers' own
    ref_logits, ref_grads = _logits_and_grads(plain, ids, mask)
    assert fused_layers.install(fused)["rotary"] == 1
    logits, grads = _logits_and_grads(fused, ids, mask)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's form, ``(1 + w) * normed``: not the formula, so it must keep its own forward."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class GeluMLP(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))


def test_modules_with_other_math_keep_their_forward():
    model = torch.nn.Sequential(OffsetRMSNorm(8), GeluMLP(8))
    assert fused_layers.install(model) == {"rms_norm": 0, "mlp": 0, "rotary": 0}
    assert all("forward" not in vars(m) for m in model)


def test_an_mlp_whose_projection_is_replaced_after_install_uses_its_own_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fused_layers.install(model)
    try:
        mlp = model.model.layers[0].mlp

        class Scaled(torch.nn.Linear):  # stands for a LoRA layer: its weight is not its whole map
            def forward(self, x):
                return 2 * super().forward(x)

        scaled = Scaled(mlp.gate_proj.in_features, mlp.gate_proj.out_features, bias=False)
        scaled.weight = mlp.gate_proj.weight
        mlp.gate_proj = scaled
        x = torch.randn(2, 3, mlp.gate_proj.in_features)
        with torch.no_grad():
            expected = mlp.down_proj(mlp.act_fn(2 * (x @ scaled.weight.T)) * mlp.up_proj(x))
            torch.testing.assert_close(mlp(x), expected)
    finally:
        fused_layers.uninstall(model)
        fused_layers.restore_rotary()
    assert "forward" not in vars(model.model.layers[0].mlp)


def test_compile_layers_is_refused_off_cpu_and_under_gradient_checkpointing():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="single-process CPU"):
        compile_policy_layers(model, torch.device("cuda"), Config())
    cfg = Config()
    cfg.model.gradient_checkpointing = True
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        compile_policy_layers(model, torch.device("cpu"), cfg)
    with pytest.raises(ConfigError, match="no RMSNorm"):
        compile_policy_layers(model, torch.device("cpu"), Config())


def test_grpo_with_compiled_layers_learns(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch import load_config, train
    from test_train_e2e import digit_task, tiny_overrides

    overrides = tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "trainer.compile_layers": True, "trainer.eval_before": False, "trainer.eval_after": False})
    try:
        result = train(load_config(None, overrides))
    finally:
        fused_layers.restore_rotary()  # process-wide
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
