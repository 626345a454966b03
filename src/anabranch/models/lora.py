"""LoRA adapters through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

Each adapted linear layer computes ``W x + (α/r)·B A x`` with ``A ∈ R^{r×d_in}``, ``B ∈ R^{d_out×r}``
and ``B = 0`` at the start, so the adapted model starts equal to the base model. Only ``A, B``
train. The KL reference policy is the same model with the adapters disabled (peft's
``disable_adapter()``), so it costs no second copy of the weights. Exports merge ``W + (α/r)·BA``
into plain Hugging Face weights that transformers and vLLM load without peft.
"""

from __future__ import annotations

import copy

import torch

from anabranch.config import ConfigError, LoraConfig, ModelConfig


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


def apply_lora(model, cfg: LoraConfig, gradient_checkpointing: bool = False):
    """Wrap ``model`` with trainable LoRA adapters (base weights frozen); ``r=0`` returns it unchanged."""
    if cfg.r <= 0:
        return model
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    targets = list(cfg.target_modules) or "all-linear"
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=targets, task_type="CAUSAL_LM")
    if isinstance(targets, list):
        # peft's own error is a traceback that lists nothing: name the key and what the model has.
        linear = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                         if isinstance(mod, torch.nn.Linear)})
        missing = [t for t in targets if not any(name == t or name.endswith("." + t)
                                                 for name, _ in model.named_modules())]
        if missing:
            raise ConfigError(f"model.lora.target_modules: no module of the model is named {missing}; its linear "
                              f"layers are {linear} (or leave the list empty for all linear layers)")
    model = get_peft_model(model, peft_cfg)
    if gradient_checkpointing:
        # Frozen embeddings give checkpointed blocks inputs without grad; this restores the path.
        model.enable_input_require_grads()
    return model


class AdapterDisabledReference:
    """The reference policy of a LoRA run: the base model, reached by switching the adapters off.

    It offers the policy's decoder and LM head (``get_decoder``, ``get_output_embeddings``) as the
    lean log-prob path uses them (models/logprobs.py), the decoder running with its adapters off,
    so the reference log-probs are computed by the same kernels as the policy's unshared forward
    (and without the full [rows, R, V] logits): at the start of a run (B = 0) they are bitwise
    equal, and the KL term has exactly zero gradient, as with a separately loaded reference.
    (Through the full-logits fallback they differed by float rounding, ~5e-7, a noise gradient
    that Adam's normalization turns into lr-sized steps of the adapters when the advantages are
    zero.) It takes the shared prompt prefix exactly where the policy does
    (models/shared_prefix.py asks the policy), so both run the same path. An adapted LM head (``lm_head`` in
    ``target_modules``) is not a plain Linear, so the lean path is not taken and ``__call__`` runs
    with every adapter off; nor where the policy itself does not take it (an FSDP2 root gathers its
    weights in its forward).
    """

    def __init__(self, peft_model):
        self.model = peft_model

    @property
    def config(self):
        return self.model.config

    @torch.no_grad()
    def __call__(self, **kwargs):
        with self.model.disable_adapter():
            return self.model(**kwargs)

    def get_output_embeddings(self):
        from anabranch.models.chunked_logprobs import supports_chunked_head

        # None where the policy itself may not split decoder and head (an FSDP2 root): then the
        # reference runs the whole model's forward too.
        return self.model.get_output_embeddings() if supports_chunked_head(self.model) else None

    def get_decoder(self):
        decoder = self.model.get_decoder()
        model = self.model

        @torch.no_grad()
        def run_without_adapters(**kwargs):
            with model.disable_adapter():
                return decoder(**kwargs)

        return run_without_adapters

    def parameters(self):
        return self.model.parameters()


def reference_policy(model, cfg: ModelConfig, load):
    """The KL reference: adapters off for a LoRA policy, else a frozen copy made by ``load()``."""
    return AdapterDisabledReference(model) if is_peft(model) else load()


def plain_model(model):
    """A model ``save_pretrained`` writes as plain HF weights: LoRA merged into a copy, else itself.

    A LoRA policy sharded with FSDP2 gives a weightless (meta-device) plain model of the same
    architecture instead: merging its ``DTensor`` shards would run collectives on the one rank that
    writes, and would hold only shards anyway. It is only the skeleton for ``save_pretrained``
    (config, class, tied weights); the weights written are the ``state_dict`` passed with it, the
    full merged ones from :func:`merge_full_state`."""
    if not is_peft(model):
        return model
    from anabranch.trainer.sharded_state import is_fsdp2

    if is_fsdp2(model):
        from transformers import AutoModelForCausalLM

        base = model.get_base_model()
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
    return copy.deepcopy(model).merge_and_unload()


def merge_full_state(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA policy's full state dict (peft names, as gathered from FSDP2 shards) -> plain HF
    names with every adapter merged, ``W + (α/r)·B A``: what ``model/`` and exports hold.

    The sharded counterpart of :func:`merged_state_dict`, computed from full tensors on the rank
    that writes, so no collective runs there. ``model`` supplies the layout (which layers carry
    adapters, their scaling and active adapters), not the weights."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    prefix = next(name + "." for name, mod in model.named_modules() if mod is base)
    deltas = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for a in (a for a in module.active_adapters if a in module.lora_A):
            A = state[f"{prefix}{name}.lora_A.{a}.weight"]
            B = state[f"{prefix}{name}.lora_B.{a}.weight"]
            # The same product peft's get_delta_weight forms (fan_in_fan_out: GPT-2's Conv1D layout).
            delta = (B @ A).T if module.fan_in_fan_out else B @ A
            delta = delta * module.scaling[a]
            deltas[name] = delta if name not in deltas else deltas[name] + delta
    return _merged_plain(((k[len(prefix):] if k.startswith(prefix) else k, v) for k, v in state.items()), deltas)


def _merged_plain(items, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base-model state ``items`` (peft names) -> plain HF names, the adapter tensors dropped and each
    adapted layer's weight plus its delta (``deltas``: layer name -> the summed (α/r)·B A)."""
    out = {}
    for key, value in items:
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            owner, _, leaf = key.partition(".base_layer.")
            key = f"{owner}.{leaf}"
            if leaf == "weight" and owner in deltas:
                value = value + deltas[owner].to(value.dtype)
        out[key] = value
    return out


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Plain HF parameter names -> merged weights, without copying the model.

    What a rollout engine (vLLM) loads after each update to sample from the current policy; for a
    model without adapters it is the model's own state dict.
    """
    if not is_peft(model):
        return dict(model.state_dict())
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            active = [a for a in module.active_adapters if a in module.lora_A]
            if active:
                deltas[name] = sum(module.get_delta_weight(a) for a in active)
    return _merged_plain(((k, v.detach()) for k, v in base.state_dict().items()), deltas)
