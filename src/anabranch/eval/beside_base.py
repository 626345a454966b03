"""The analyses of ``anabranch eval`` that need the base (first) model loaded beside a trained one:
sparse selection (:mod:`anabranch.eval.sparse_selection`, ``--sparse-tokens``) and the KL to the
base of the best-of-n frontier (:mod:`anabranch.eval.bon_frontier`, ``--bon-frontier``).

The base is loaded once per trained model and checked once (same tokens, same vocabulary), then
each analysis that is on runs with it; with both on, a base model costs one load, not two. A base
that cannot be compared, or does not fit in memory, gives each analysis an entry with ``error``
and the trained model's other results are kept.
"""

from __future__ import annotations

import dataclasses
import gc

import torch


def vocab_size(model) -> int:
    """Rows of the model's output projection (its config's vocab_size without a linear head)."""
    return getattr(model.get_output_embeddings(), "out_features", None) or model.config.vocab_size


def load_comparable_base(cfg, base_spec, trained, tokenizer, device):
    """(base model, None) loaded beside ``trained``, or (None, why) when their token ids do not mean
    the same tokens (different tokenizers, or vocabularies of different sizes)."""
    from anabranch.models.loading import load_model, load_tokenizer

    if not cfg.model.tokenizer:  # each model has its own tokenizer: the ids must mean the same tokens
        if load_tokenizer(dataclasses.replace(cfg.model, path=base_spec.path)).get_vocab() != tokenizer.get_vocab():
            return None, ("the base and trained tokenizers differ, so the same token id does not name the same "
                          "token in both models")
    base = load_model(dataclasses.replace(cfg.model, path=base_spec.path), device, trainable=False)
    vb, vt = vocab_size(base), vocab_size(trained)
    if vb != vt:
        del base
        return None, f"the base model's vocabulary has {vb} entries and the trained model's {vt}"
    return base, None


def _free(device) -> None:
    # Before a second model loads, and between analyses: what the last one left goes first.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare_with_base(cfg, base_spec, trained, tokenizer, sequences: list, settings, device) -> dict:
    """``{"sparse_selection": ..., "kl_to_base": ...}`` for the analyses ``settings`` turns on
    (``sparse_tokens > 0``, ``bon_frontier``), all with one loaded base."""
    from anabranch.eval import bon_frontier, sparse_selection

    wanted = {}  # entry key: (run with the loaded base, fields of its error entry, how to skip it)
    if settings.sparse_tokens > 0:
        wanted["sparse_selection"] = (
            lambda base: sparse_selection.against_base(base_spec.label, base, trained, sequences,
                                                       settings.sparse_tokens),
            {"base": base_spec.label, "max_tokens": settings.sparse_tokens}, "rerun with --sparse-tokens 0 to skip")
    if settings.bon_frontier:
        wanted["kl_to_base"] = (lambda base: bon_frontier.kl_to_base(trained, base, sequences, settings.temperature),
                                {"temperature": settings.temperature}, "rerun without --bon-frontier to skip")
    if not wanted:
        return {}
    _free(device)
    oom = "out of memory with the base model loaded beside it ({}); {}"
    try:
        base, why = load_comparable_base(cfg, base_spec, trained, tokenizer, device)
    except torch.OutOfMemoryError as err:
        base, why = None, err
    out = {}
    for key, (run, head, skip) in wanted.items():
        if base is None:
            out[key] = {**head, "error": oom.format(why, skip) if isinstance(why, BaseException) else why}
            continue
        try:
            out[key] = run(base)
        except torch.OutOfMemoryError as err:  # the entry's other results are kept
            out[key] = {**head, "error": oom.format(err, skip)}
        _free(device)
    del base
    return out
