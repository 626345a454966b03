"""Checkpoints: a Hugging Face folder for the model (loadable with no anabranch code) plus a
``trainer_state.pt`` with what resuming needs (optimizer, step, data position, RNG states, extra
heads). Each is written under a temporary name and renamed when complete."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from anabranch.models.loading import save_hf


def export_hf(model, tokenizer, path: Path) -> Path:
    """Atomically write a plain Hugging Face checkpoint of the policy."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


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


def save_checkpoint(run_path: Path, step: int, model, tokenizer, optimizer, state: dict) -> Path:
    path = Path(run_path) / "checkpoints" / f"step-{step:06d}"
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp / "model")
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), **state},
               tmp / "trainer_state.pt")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path
