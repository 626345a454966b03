"""Checkpoints: a Hugging Face folder for the model (loadable with no anabranch code) plus a
``trainer_state.pt`` with what resuming needs (optimizer, step, data position, RNG states, extra
heads). Each is written under a temporary name and renamed when complete, so a folder named
``step-N`` is always whole; a crash while writing leaves only a ``step-N.tmp`` that is ignored
and cleaned up later."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from anabranch.config import one_line
from anabranch.models.loading import save_hf

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def export_hf(model, tokenizer, path: Path, state_dict: dict | None = None) -> Path:
    """Atomically write a plain Hugging Face checkpoint of the policy (``state_dict``: its full
    weights gathered from a sharded model, see :mod:`anabranch.trainer.sharded_state`)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp, state_dict=state_dict)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    # Sampling in HF generate draws from the torch global generators (CPU, and CUDA on a GPU).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def module_states(modules: dict) -> dict:
    """State dicts of the extra trainable heads (log Z, value), saved under ``"modules"``."""
    return {name: module.state_dict() for name, module in modules.items()}


def load_module_states(modules: dict, trainer_state: dict) -> None:
    """Restore the extra heads from a loaded ``trainer_state.pt``; the names must match exactly."""
    saved = trainer_state.get("modules", {})
    if set(saved) != set(modules):
        raise ValueError(f"checkpoint holds extra heads {sorted(saved)} but this run builds {sorted(modules)}; "
                         "resume with the same algorithm settings that wrote the checkpoint")
    for name, module in modules.items():
        module.load_state_dict(saved[name])


def checkpoint_dir(run_path: Path, step: int) -> Path:
    return Path(run_path) / "checkpoints" / f"step-{step:06d}"


def staging_dir(run_path: Path, step: int) -> Path:
    """Where ``step-N`` is written before the rename that commits it."""
    path = checkpoint_dir(run_path, step)
    return path.with_name(path.name + ".tmp")


def save_checkpoint(run_path: Path, step: int, model, tokenizer, optimizer, state: dict,
                    keep_last: int = 0, model_state: dict | None = None, optimizer_state: dict | None = None,
                    staged: bool = False) -> Path:
    """Write ``checkpoints/step-N`` atomically, then delete all but the ``keep_last`` newest.

    ``model_state`` / ``optimizer_state``: full states gathered from a sharded run, written instead
    of the local module's and optimizer's. ``staged``: the staging folder already holds files
    written by every rank (a DeepSpeed engine state) and must be kept, not cleared."""
    path, tmp = checkpoint_dir(run_path, step), staging_dir(run_path, step)
    folder = path.parent
    if not staged:
        shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp / "model", state_dict=model_state)
    optim = optimizer.state_dict() if optimizer_state is None else optimizer_state
    torch.save({"step": step, "optimizer": optim, "rng": rng_state(), **state}, tmp / STATE_FILE)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)  # the commit point: before it only step-N.tmp exists
    rotate(folder, keep_last)
    return path


def is_complete(path: Path) -> bool:
    return (_STEP_DIR.match(path.name) is not None and (path / STATE_FILE).is_file()
            and (path / "model" / "config.json").is_file())


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = [p for p in folder.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(done, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def rotate(folder: Path, keep_last: int) -> None:
    """Delete leftovers of interrupted writes and, if ``keep_last`` > 0, the oldest checkpoints."""
    for leftover in Path(folder).glob("step-*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last > 0:
        for old in list_checkpoints(folder)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


class DamagedCheckpoint(Exception):
    """A checkpoint file that cannot be read (cut short, overwritten, copied in part)."""


def load_state(path: Path) -> dict:
    # Our own file; it holds numpy/python RNG states, which the weights-only unpickler refuses.
    try:
        return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated zip, a pickle cut short, an empty file
        raise DamagedCheckpoint(f"{Path(path) / STATE_FILE} cannot be read ({one_line(exc)})") from exc


def discard_after(folder: Path, step: int) -> list[Path]:
    """Rename the complete checkpoints after ``step`` to ``step-N.discarded`` and return their new paths.

    A run resumed from ``step`` replaces what came after it (its log rows are cut too); checkpoints
    left from that abandoned trajectory would otherwise be taken by ``trainer.resume=auto`` for this
    run's newest, and by ``trainer.keep_last`` for newer than the ones it writes. Renamed, not
    deleted: they stay on disk for the user to keep or delete."""
    moved = []
    for old in list_checkpoints(folder):
        if int(_STEP_DIR.match(old.name).group(1)) > step:
            new = old.with_name(old.name + ".discarded")
            shutil.rmtree(new, ignore_errors=True)
            old.rename(new)
            moved.append(new)
    return moved


def adapter_state(model) -> dict | None:
    """The trainable tensors of a LoRA policy (peft names), saved under ``"adapter"``; None for a
    plain model. ``model/`` holds the adapters merged into the base weights, which cannot be split
    back into base and adapters, so resuming a LoRA run restores these instead.

    Sharded with FSDP2, each parameter is a ``DTensor`` shard and its full tensor is gathered: a
    collective, so every rank must call this, in the same order (as for the rest of the state)."""
    from anabranch.models.lora import is_peft

    if not is_peft(model):
        return None
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = t.to("cpu", copy=True)
    return out


def load_adapter_state(model, state: dict) -> None:
    """Copy saved LoRA tensors into ``model`` in place (the frozen base weights come from
    ``model.path``, as in the run that wrote them); the names must match exactly. Under FSDP2 every
    rank passes the same full tensors and keeps its own shard of each (a collective)."""
    from anabranch.trainer.sharded_state import is_fsdp2, load_full_params

    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"the checkpoint's LoRA adapters do not match this run's (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}): model.lora settings differ")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != state[name].shape:
                raise ValueError(f"LoRA tensor {name} has shape {tuple(state[name].shape)} in the checkpoint "
                                 f"and {tuple(p.shape)} in this run: model.lora.r or the model differ")
        if is_fsdp2(model):  # DTensor shards: the same slicing as the other full states take
            load_full_params(model, state)
            return
        for name, p in params.items():
            p.copy_(state[name])


def load_model_weights(model, path: Path, trainer_state: dict | None = None) -> None:
    """Copy the weights saved in ``path/model`` into ``model`` in place (same tensors, so an
    optimizer built on them stays valid). Loading through transformers handles tied weights and
    any key renaming it applies when saving; fp32 safetensors round-trip bit for bit. A model
    sharded with FSDP2 takes its own shard of the full weights (every rank must call this).
    A LoRA policy takes its adapters from ``trainer_state["adapter"]`` (see :func:`adapter_state`)."""
    from transformers import AutoModelForCausalLM

    from anabranch.models.lora import is_peft
    from anabranch.trainer.sharded_state import is_fsdp2, load_full_model_state

    if is_peft(model):
        adapters = (trainer_state or {}).get("adapter")
        if adapters is None:
            raise ValueError(f"{path} holds no LoRA adapter weights (only merged ones): it was written by a run "
                             "without model.lora, or by a version of anabranch that did not save adapters")
        load_adapter_state(model, adapters)
        return

    dtype = next(model.parameters()).dtype
    try:
        saved = AutoModelForCausalLM.from_pretrained(str(Path(path) / "model"), dtype=dtype)
    except Exception as exc:  # a missing or cut-short file of the checkpoint's own model folder
        raise DamagedCheckpoint(f"{Path(path) / 'model'} cannot be loaded ({one_line(exc)})") from exc
    if is_fsdp2(model):
        load_full_model_state(model, saved.state_dict())
    else:
        with torch.no_grad():
            model.load_state_dict(saved.state_dict(), strict=True)
    del saved
