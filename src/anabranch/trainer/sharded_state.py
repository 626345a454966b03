"""Whole-model and whole-optimizer state of a sharded policy (FSDP2, DeepSpeed ZeRO-3), for saving.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``, what accelerate's ``fsdp_version: 2`` applies)
each rank's parameters are ``DTensor`` shards; under ZeRO-3 they are DeepSpeed partitions. A
checkpoint or an export written by rank 0 from its own module would then hold one shard. Here the
full state is gathered first, with the engines' own collectives:

- FSDP2: ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
  ``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True`` (every rank takes
  part; rank 0 receives full CPU tensors, the others an empty dict). Loading back uses the
  ``set_*`` counterparts with the full dict on every rank, each keeping its own shard, so a run can
  even resume with a different number of processes.
- DeepSpeed ZeRO-3: ``accelerator.get_state_dict`` (the engine's consolidated 16-bit state; the
  config needs ``zero3_save_16bit_model: true``). Its optimizer state lives in the engine and is
  saved with ``accelerator.save_state`` into the checkpoint's ``engine/`` folder.

Every function here is a collective when the policy is sharded: all ranks must call it, in the
same order. For an unsharded policy (one process, DDP) they do nothing and return ``None`` so the
caller keeps its plain single-copy path.
"""

from __future__ import annotations

from typing import Any

import torch


def is_fsdp2(module) -> bool:
    """True for a module sharded with ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(module, FSDPModule)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


class _WithHeads(torch.nn.Module):
    """The policy plus the extra trainable heads, so every optimizer parameter has a name."""

    def __init__(self, policy, heads: dict):
        super().__init__()
        self.policy = policy
        self.heads = torch.nn.ModuleDict(heads)


def full_model_state(dist, model) -> dict | None:
    """The policy's full state dict on rank 0 (``{}`` elsewhere); ``None`` when it is not sharded.

    A LoRA policy's is merged (plain HF names, ``W + (α/r)·B A``), like the ``model/`` folder of
    an unsharded LoRA run; its unmerged adapters are saved apart (checkpoint.adapter_state)."""
    if not dist.sharded:
        return None
    if is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from anabranch.models.lora import is_peft, merge_full_state

        state = get_model_state_dict(model, options=_options(cpu_offload=True))
        return merge_full_state(model, state) if state and is_peft(model) else state
    state = dist.accelerator.get_state_dict(dist.policy(model))  # DeepSpeed ZeRO-3
    return state if dist.is_main else {}


def full_optimizer_state(dist, model, optimizer, heads: dict) -> dict | None:
    """The optimizer's full state on rank 0 (``{}`` elsewhere); ``None`` when not sharded or when
    the engine keeps it (DeepSpeed: see :func:`save_engine_state`)."""
    if not dist.sharded or not is_fsdp2(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_WithHeads(model, heads), optimizer, options=_options(cpu_offload=True))


def load_full_model_state(model, state: dict) -> None:
    """Give every rank its shard of a full state dict (all ranks pass the same full dict)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def load_full_params(model, state: dict) -> None:
    """Give every rank its shard of some of the parameters (full tensors, the same on all ranks),
    leaving the others as they are: a LoRA policy's adapters over the base weights it loaded."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    result = set_model_state_dict(model, state, options=_options(strict=False))
    if result.unexpected_keys:  # the caller checked names; strict=False must not hide a stray key
        raise ValueError(f"parameters not in the model: {sorted(result.unexpected_keys)[:3]}")


def load_full_optimizer_state(model, optimizer, heads: dict, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(_WithHeads(model, heads), optimizer, state, options=_options())


def uses_engine_state(dist) -> bool:
    """DeepSpeed keeps optimizer state inside its engine: checkpoints save it with accelerate."""
    if dist.accelerator is None:
        return False
    from accelerate.utils import DistributedType

    return dist.accelerator.distributed_type == DistributedType.DEEPSPEED


def save_engine_state(dist, folder) -> None:
    """``accelerator.save_state`` (every rank writes its partition; a collective)."""
    dist.accelerator.save_state(str(folder))


def load_engine_state(dist, folder) -> None:
    dist.accelerator.load_state(str(folder))


def to_full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Replace ``DTensor`` values by full tensors (a collective per sharded tensor; for engines
    that need the whole weights on every rank, such as one vLLM engine per rank)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return state
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}
