"""Compiled element-wise parts of Llama-style decoder layers, for the CPU training update.

On CPU the matrix products of SmolLM2's update already run near the matmul peak; about a fifth of
its time is the element-wise work around them, each a separate pass over memory in eager mode and
again in the backward: RMSNorm (``w * x * rsqrt(mean(x^2) + eps)``), the gated MLP's
``silu(x W_g^T) * (x W_u^T)`` and the rotary embedding (``q cos + rotate_half(q) sin``). Compiling
these three functions with ``torch.compile`` (Inductor fuses each chain, forward and backward, into
a few loops; the products stay library calls) made the W1 update 5-12% faster in alternating A/Bs
(docs/benchmarks.md). The functions are compiled once with dynamic shapes, so micro-batches of any
length reuse them; the first update pays the compilation (about 35 s on 2 cores, less when
Inductor's on-disk cache has them).

:func:`install` swaps them in only where they compute what the model's own code computes: a module
is taken when its class's output equals the eager formula on a random input (checked once per class,
so Gemma's ``(1 + w)`` norm or an MLP with another activation keeps its own forward), the MLP's
projections are plain bias-free ``nn.Linear`` (checked at every call, so LoRA layers added later
fall back to the model's forward), and the rotary function is replaced in the transformers module
of the attention class (for every model of that architecture in the process) only when it equals
the formula. Weights, ``state_dict`` and checkpoints are untouched.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, the mean over the last dim, computed in float32."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gated_silu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``(silu(x W_gate^T) * x W_up^T) W_down^T`` (the SwiGLU MLP of Llama, Qwen2, SmolLM2)."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x cos + rotate_half(x) sin`` for q and k [B, heads, T, D]; cos and sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


_compiled: dict = {}
# transformers modules whose apply_rotary_pos_emb was replaced -> their own function
_replaced_rotary: dict = {}


def _compiled_fn(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def _is_rms_norm(module) -> bool:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or not isinstance(eps, float):
        return False
    x = torch.randn(2, 3, weight.shape[0], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        return _same(module(x), rms_norm(x, weight, eps))


def _plain_linear(layer) -> bool:
    return type(layer) is torch.nn.Linear and layer.bias is None


def _is_gated_silu_mlp(module) -> bool:
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(_plain_linear(p) for p in projections):
        return False
    gate, up, down = projections
    x = torch.randn(2, 3, gate.in_features, dtype=gate.weight.dtype, device=gate.weight.device)
    with torch.no_grad():
        return _same(module(x), gated_silu_mlp(x, gate.weight, up.weight, down.weight))


def _fused_norm_forward(module):
    fused = _compiled_fn(rms_norm)

    def forward(x):
        return fused(x, module.weight, module.variance_epsilon)
    return forward


def _fused_mlp_forward(module, original):
    fused = _compiled_fn(gated_silu_mlp)

    def forward(x):
        gate, up, down = module.gate_proj, module.up_proj, module.down_proj
        if not (_plain_linear(gate) and _plain_linear(up) and _plain_linear(down)):
            return original(x)  # e.g. LoRA layers put in after install
        return fused(x, gate.weight, up.weight, down.weight)
    return forward


def _install_rotary(attention_class) -> bool:
    """Replace ``apply_rotary_pos_emb`` in the module defining ``attention_class`` when it equals
    :func:`rotary`; True when the compiled version is (now or already) in place."""
    namespace = sys.modules.get(attention_class.__module__)
    original = getattr(namespace, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, "_anabranch_fused", False):
        return True
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    angles = torch.randn(2, 5, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    try:
        theirs = original(q, k, cos, sin)
    except Exception:  # another signature: leave it alone
        return False
    ours = rotary(q, k, cos, sin)
    if not (isinstance(theirs, tuple) and len(theirs) == 2 and all(_same(a, b) for a, b in zip(theirs, ours))):
        return False
    fused = _compiled_fn(rotary)

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or kwargs.get("unsqueeze_dim", 1) != 1 or len(kwargs) > 1 or q.dim() != 4:
            return original(q, k, cos, sin, *args, **kwargs)
        return fused(q, k, cos, sin)

    apply_rotary_pos_emb._anabranch_fused = True
    namespace.apply_rotary_pos_emb = apply_rotary_pos_emb
    _replaced_rotary[namespace.__name__] = original
    return True


def install(model) -> dict[str, int]:
    """Swap the compiled functions into ``model`` where they are exact (see the module docstring);
    returns how many norms and MLPs were taken and whether the rotary function was."""
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0}
    checked: dict[type, bool] = {}
    rotary_classes = set()
    for module in model.modules():
        if getattr(module, "_anabranch_fused", False):
            continue
        cls = type(module)
        name = cls.__name__
        if name.endswith("RMSNorm"):
            if checked.setdefault(cls, _is_rms_norm(module)):
                module.forward = _fused_norm_forward(module)
                module._anabranch_fused = True
                counts["rms_norm"] += 1
        elif name.endswith("MLP") and hasattr(module, "gate_proj"):
            if checked.setdefault(cls, _is_gated_silu_mlp(module)):
                module.forward = _fused_mlp_forward(module, module.forward)
                module._anabranch_fused = True
                counts["mlp"] += 1
        elif name.endswith("Attention"):
            rotary_classes.add(cls)
    counts["rotary"] = int(any([_install_rotary(cls) for cls in rotary_classes]))
    log.info("compiled layers: %d RMSNorm, %d MLP, rotary %s", counts["rms_norm"], counts["mlp"],
             "yes" if counts["rotary"] else "no")
    return counts


def uninstall(model) -> None:
    """Give ``model``'s modules their own forward back (the rotary function: :func:`restore_rotary`)."""
    for module in model.modules():
        if getattr(module, "_anabranch_fused", False):
            del module.forward
            del module._anabranch_fused


def restore_rotary() -> None:
    """Put back every transformers module's own ``apply_rotary_pos_emb`` (it is process-wide)."""
    for name, original in _replaced_rotary.items():
        sys.modules[name].apply_rotary_pos_emb = original
    _replaced_rotary.clear()
