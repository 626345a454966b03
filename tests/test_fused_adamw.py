"""The trainer's AdamW uses torch's fused kernel and makes the same updates as the reference one."""

import torch

from anabranch.config import Config
from anabranch.trainer.components import adamw, build_optimizer


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((300, 40), (40,), (7, 3, 5))]


def test_fused_adamw_matches_the_for_loop_implementation_over_steps():
    fused_p, ref_p = _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    fused = adamw([{"params": fused_p[:2]}, {"params": fused_p[2:], "lr": 3e-2}], **kw)
    ref = torch.optim.AdamW([{"params": ref_p[:2]}, {"params": ref_p[2:], "lr": 3e-2}], foreach=False, **kw)
    assert fused.defaults["fused"] is True and not ref.defaults.get("fused")
    g = torch.Generator().manual_seed(1)
    start = [p.detach().clone() for p in ref_p]
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in ref_p]
        for p, q, grad in zip(fused_p, ref_p, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        fused.step()
        ref.step()
    for p, q, s in zip(fused_p, ref_p, start):
        assert (q - s).abs().max() > 1e-2  # the weights moved
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6)


def test_build_optimizer_is_fused_on_cpu():
    cfg = Config()
    model = torch.nn.Linear(4, 3)
    head = torch.nn.Linear(3, 1)
    head.lr_multiplier = 2.0
    opt = build_optimizer(cfg, model, {"head": head})
    assert opt.defaults["fused"] is True
    assert [g["lr"] for g in opt.param_groups] == [cfg.trainer.lr, 2 * cfg.trainer.lr]
