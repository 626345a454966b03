"""The whole update (objective + critic + KL in the reward for ppo, ppo_epochs=2) gives the same gradient whatever the micro-batch size."""

import pytest
import torch

from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ModelConfig
from anabranch.models.loading import load_model
from anabranch.trainer.advantage_pass import compute_advantages
from anabranch.trainer.step import policy_update

from test_dapo_batch import fake_rollout


@pytest.mark.parametrize("name,mode", [("ppo", "seq-mean-token-mean"), ("gspo", "seq-mean-token-mean"),
                                       ("dr_grpo", "seq-mean-token-sum-norm")])
def test_micro_batches_give_the_full_batch_gradient(tiny_model_dir, name, mode):
    torch.manual_seed(0)
    r = fake_rollout(2, 3, 3, 4)
    r.prompt_ids = torch.randint(3, 60, r.prompt_ids.shape)
    r.response_ids = torch.randint(3, 60, r.response_ids.shape)
    r.response_mask[1, 2:] = 0
    r.response_mask[4, 1:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    algo = resolve_algorithm(AlgorithmConfig(name=name, loss_agg_mode=mode))
    ref = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grads = []
    for micro in (6, 2, 1):
        model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
        torch.manual_seed(1)
        modules = {k: f(model.config, algo.cfg) for k, f in algo.module_factories.items()}
        for m in modules.values():  # a non-zero head, so the critic has a gradient into the trunk
            torch.nn.init.normal_(m.proj.weight, std=0.1)
        params = list(model.parameters()) + [p for m in modules.values() for p in m.parameters()]
        opt = torch.optim.SGD(params, lr=0.0)
        adv = compute_advantages(algo, model, r, rewards, micro_batch_size=micro, temperature=1.0, modules=modules,
                                 ref_model=ref)
        metrics = policy_update(model, opt, r, adv.advantages, rewards, algo, micro_batch_size=micro, grad_clip=0.0,
                                temperature=1.0, max_response_len=4, modules=modules, precomputed=adv.precomputed,
                                ref_model=ref)
        grads.append((torch.cat([p.grad.flatten() for p in params]), metrics["loss"]))
    for g, loss in grads[1:]:
        assert loss == pytest.approx(grads[0][1], rel=1e-4, abs=1e-6)
        assert torch.allclose(g, grads[0][0], rtol=1e-3, atol=1e-6)
    assert grads[0][0].abs().sum() > 0
