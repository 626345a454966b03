"""Run a prompt once for the n samples that share it, then only their response tokens.

A GRPO-style batch holds n completions of each prompt, so the ``[prompt | response]`` sequences of
a group start with n identical copies of the prompt. A causal model's states at the prompt
positions depend only on the prompt, so they are the same for all n rows: computing them n times
is wasted work (for W1 on SmolLM2 the prompts are about half of the tokens). Here the prompt of
each group runs once, with a KV cache; the cache is then expanded to the group's rows (an index
select, which autograd differentiates by summing the n rows' gradients back onto the single
prompt forward), and the response tokens run on top of it with the full ``[prompt | response]``
attention mask and the positions ``generate`` used. The result equals the unshared forward up to
float rounding, hidden states and gradients included (tests/test_shared_prefix.py).

This is used only where it is exact and supported (:func:`supports_shared_prefix`): a plain
Hugging Face decoder (not a DDP/FSDP/DeepSpeed wrapper nor ZeRO-3 partitioned weights, whose
forward hooks must run the same way on every rank), whose cache is made of plain full-attention
layers (no sliding window or recurrent state), with no gradient checkpointing (transformers drops
the cache under it) and no active dropout (one mask would be shared by the group's rows). Rows
share a prompt only when their prompt ids and masks are equal and the rows are adjacent
(:func:`prefix_groups`); otherwise callers run the ordinary forward.
"""

from __future__ import annotations

from typing import Optional

import torch


def prefix_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Group of each row [B] (0, 0, ..., 1, 1, ...) for runs of adjacent rows with identical prompt
    ids and mask, or ``None`` when no two adjacent rows share their prompt (nothing to save)."""
    if prompt_ids.shape[0] < 2 or prompt_ids.shape[1] == 0:
        return None
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
    if not bool(same.any()):
        return None
    starts = torch.cat([same.new_ones(1), ~same])
    return starts.long().cumsum(0) - 1


def _dropout_active(model) -> bool:
    if not model.training:
        return False
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)
    values = vars(cfg) if cfg is not None and hasattr(cfg, "__dict__") else {}
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and v > 0
               for k, v in values.items() if k != "classifier_dropout")


def _plain_cache(model):
    """A new DynamicCache for ``model`` when every layer of it is a plain (full-attention) layer."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - transformers without layered caches
        return None
    cache = DynamicCache(config=model.config)
    if not all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [])):
        return None
    return cache


def supports_shared_prefix(model) -> bool:
    """Whether :func:`shared_prefix_hidden` gives exactly the ordinary forward for this model."""
    from transformers import PreTrainedModel

    from anabranch.models.chunked_logprobs import supports_chunked_head

    from anabranch.models.lora import AdapterDisabledReference

    if isinstance(model, AdapterDisabledReference):  # a LoRA run's reference: the policy, adapters off
        model = model.model
    base = model
    try:  # LoRA: the peft wrapper forwards to the Hugging Face model inside it
        from peft import PeftModel

        if isinstance(model, PeftModel):
            base = model.get_base_model()
    except ImportError:  # pragma: no cover - peft is a dependency
        pass
    if not isinstance(base, PreTrainedModel) or not supports_chunked_head(model):
        return False  # DDP / DeepSpeed engines wrap the model and need their own forward
    try:
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            return False  # FSDP2 gathers sharded weights in forward hooks of the outer modules
    except ImportError:  # pragma: no cover
        pass
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        # DeepSpeed ZeRO-3 partitions the weights and gathers them in every module's forward, a
        # collective: all ranks must call the decoder equally often, whatever their prompts.
        return False
    if model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return False
    if _dropout_active(model):
        return False
    return _plain_cache(base) is not None


def shared_prefix_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         prompt_len: int, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-layer hidden states of ``[prompt | response]`` rows whose prompts are shared within ``group``.

    Returns ``(prompt_hidden [G, P, H], response_hidden [B, R, H])``; row ``i``'s full hidden
    states are ``cat(prompt_hidden[group[i]], response_hidden[i])``.
    """
    prompt_out = _group_prefill(model, input_ids[:, :prompt_len], attention_mask[:, :prompt_len],
                                position_ids[:, :prompt_len], group)
    response_out = model.get_decoder()(input_ids=input_ids[:, prompt_len:], attention_mask=attention_mask,
                                       position_ids=position_ids[:, prompt_len:],
                                       past_key_values=prompt_out.past_key_values, use_cache=True)
    return prompt_out.last_hidden_state, response_out.last_hidden_state


def _group_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   group: torch.Tensor):
    """The decoder over the first row of each group (runs of equal ``group``), its KV cache then
    expanded to every row of the group: an index select, which autograd differentiates by summing
    the rows' gradients back onto the single forward."""
    first = torch.ones_like(group, dtype=torch.bool)
    first[1:] = group[1:] != group[:-1]
    cache = _plain_cache(model.get_base_model() if hasattr(model, "get_base_model") else model)
    out = model.get_decoder()(input_ids=input_ids[first], attention_mask=attention_mask[first],
                              position_ids=position_ids[first], past_key_values=cache, use_cache=True)
    out.past_key_values.batch_select_indices(group.to(input_ids.device))  # [G, ...] -> [B, ...]
    return out


@torch.no_grad()
def shared_prompt_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """For ``generate``: a KV cache of every row's prompt but its last token, each distinct prompt of
    adjacent identical rows computed once and the cache expanded to the rows (``None`` when no two
    adjacent rows share a prompt, the prompt is a single token, or the model is not supported).

    ``generate`` given this cache runs only the prompts' last token before it samples, with the
    positions it would use itself; the n samples of a prompt then cost one prefill instead of n."""
    from anabranch.models.logprobs import position_ids_from_mask

    group = prefix_groups(prompt_ids, prompt_mask)
    # Left padding only: the cache must stop right before every row's last real token.
    if group is None or prompt_ids.shape[1] < 2 or not bool(prompt_mask[:, -1].all()) \
            or not supports_shared_prefix(model):
        return None
    mask = prompt_mask[:, :-1]
    return _group_prefill(model, prompt_ids[:, :-1], mask, position_ids_from_mask(mask), group).past_key_values
