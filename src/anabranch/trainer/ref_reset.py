"""ProRL's periodic reference-policy reset (``algorithm.ref_reset_every``).

Liu, Diao, Lu, Hu, Dong, Choi, Kautz, Dong (2025), "ProRL: Prolonged Reinforcement Learning Expands
Reasoning Boundaries in Large Language Models", arXiv 2505.24864. ProRL trains for thousands of
steps with a KL penalty to a reference policy,

    L(θ) = L_GRPO/DAPO(θ) + β · KL(π_θ ‖ π_ref),

and, so that the KL term does not come to dominate the loss as π_θ drifts away from the initial
model, it periodically hard-resets the reference to the current online policy and re-initializes
the optimizer states:

    every N training steps:  θ_ref ← θ   (so KL(π_θ ‖ π_ref) = 0 at the next forward)
                             optimizer state ← fresh (Adam moments and step counts cleared)

What is assumed here: the passage with the paper's reset rule was not found (as we recall it,
resets fall between its successive training runs, chosen by watching validation); we reset on a
fixed interval of N training steps (one ``policy_update`` each; with
``ppo_epochs=1`` that is one optimizer step). The optimizer reset clears the state of every
parameter group (extra heads included); the learning-rate schedule goes on (configs/prorl.yaml
uses a constant one). The adaptive KL controller (``kl_target``), if any, keeps its β.

Exact resume: the checkpoint holds the reset reference's weights (only once a reset has happened;
before that the reference is the initial model, which the resumed run loads anyway) and the count
of resets, through the checkpointer's ``stateful`` objects. Refused: LoRA (the reference is the
adapter-off base, which resetting would have to change), FSDP/ZeRO-3 and DeepSpeed (sharded
weights or an engine-owned optimizer state, which this plain copy and clear do not handle).
"""

from __future__ import annotations

import torch

from anabranch.config import Config, ConfigError


def check_ref_reset(cfg: Config) -> None:
    """Refuse, before any model is loaded, what the reset cannot do correctly (LoRA)."""
    every = cfg.algorithm.ref_reset_every
    if every > 0 and cfg.model.lora.r > 0:
        # With LoRA the reference is the policy with its adapters off (models/lora.py): setting it to
        # the current policy would need a second copy of the adapters; merging them into the base
        # would change what is trained, so neither is done.
        raise ConfigError(f"algorithm.ref_reset_every={every} is not supported with LoRA (model.lora.r="
                          f"{cfg.model.lora.r}): the KL reference is the adapter-off base model; train without "
                          "LoRA or set algorithm.ref_reset_every=0")


def unwrapped_optimizer(optimizer):
    """The torch optimizer under accelerate's wrapper (DDP runs), whose ``state`` is cleared."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """θ_dst ← θ_src, tensor by tensor by name (buffers too; casts to dst's dtype if it differs)."""
    dst_state = dst.state_dict()
    src_state = src.state_dict()
    missing = sorted(set(dst_state) - set(src_state))
    if missing:
        raise RuntimeError(f"reference reset: the policy has no tensors {missing[:3]}... of the reference")
    for name, tensor in dst_state.items():
        tensor.copy_(src_state[name])


class RefReset:
    """Resets ``ref_model`` to ``model`` every ``every`` steps; a ``stateful`` checkpoint object."""

    def __init__(self, every: int, reset_optimizer: bool, model, ref_model, optimizer, is_main: bool = True):
        self.every, self.reset_optimizer = int(every), bool(reset_optimizer)
        # Only rank 0 writes checkpoints; every rank builds the state, so only it copies the weights.
        self.is_main = bool(is_main)
        self.model, self.ref_model, self.optimizer = model, ref_model, optimizer
        self.resets = 0
        self.last_step = 0  # the step of the last reset; 0: the reference is still the initial model

    @classmethod
    def create(cls, cfg: Config, dist, c) -> "RefReset | None":
        """None unless ``algorithm.ref_reset_every > 0``; call after ``dist.prepare(c)``."""
        a = cfg.algorithm
        if a.ref_reset_every <= 0:
            return None
        if c.ref_model is None:  # resolve_algorithm refuses this; kept for a hand-built Components
            raise ConfigError(f"algorithm.ref_reset_every={a.ref_reset_every} needs a reference model "
                              "(algorithm.kl_coef > 0)")
        if dist.sharded or _deepspeed(dist):
            # Each rank holds a shard of the policy (FSDP/ZeRO-3) or DeepSpeed owns the optimizer
            # state: a rank-local copy and clear would be wrong there.
            raise ConfigError(f"algorithm.ref_reset_every={a.ref_reset_every} is not supported with FSDP or "
                              "DeepSpeed; use DDP (configs/accelerate/multi_gpu_ddp.yaml) or one process")
        # DDP: every rank holds the whole policy, identical across ranks, and copies its own replica.
        return cls(a.ref_reset_every, a.ref_reset_optimizer, c.model, c.ref_model, c.optimizer,
                   is_main=getattr(dist, "is_main", True))

    def after_update(self, step: int) -> dict:
        """Call after step ``step``'s optimizer update: reset on the interval; the step's metrics."""
        if step % self.every == 0:
            self.reset(step)
        return {"ref/resets": float(self.resets), "ref/steps_since_reset": float(step - self.last_step)}

    def reset(self, step: int) -> None:
        copy_weights(self.model, self.ref_model)
        if self.reset_optimizer:
            # A fresh AdamW: torch creates the moments and step count again at the next step().
            unwrapped_optimizer(self.optimizer).state.clear()
        self.resets += 1
        self.last_step = step

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        # Before the first reset the reference is the initial model, which a resumed run loads
        # itself: only a reset reference is worth its (model-sized) place in the checkpoint.
        weights = None
        if self.resets and self.is_main:  # other ranks' states are not written: no model-sized copy there
            weights = {k: v.detach().to("cpu", copy=True) for k, v in self.ref_model.state_dict().items()}
        return {"resets": self.resets, "last_step": self.last_step, "every": self.every, "ref_weights": weights}

    def load_state_dict(self, state: dict) -> None:
        self.resets, self.last_step = int(state["resets"]), int(state["last_step"])
        if state.get("ref_weights") is not None:
            self.ref_model.load_state_dict(state["ref_weights"])


def _deepspeed(dist) -> bool:
    if getattr(dist, "accelerator", None) is None:
        return False
    from accelerate.utils import DistributedType

    return dist.accelerator.distributed_type == DistributedType.DEEPSPEED
