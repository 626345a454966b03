"""One base model loaded beside a trained one for sparse selection and the best-of-n KL (eval/beside_base.py)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from anabranch.config import load_config
from anabranch.eval import beside_base
from anabranch.eval.runner import EvalSettings, ModelSpec


class Head:
    def __init__(self, vocab):
        self.head = torch.nn.Linear(2, vocab, bias=False)

    def get_output_embeddings(self):
        return self.head


CFG = load_config(None, [])
SHARED_TOKENIZER = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, tokenizer="shared-tok"))
BASE = ModelSpec("base", "base/path")
BOTH = EvalSettings(n=2, sparse_tokens=7, bon_frontier=True, temperature=0.8)


def test_a_vocabulary_mismatch_is_an_error_for_both_analyses_from_one_load(monkeypatch):
    import anabranch.models.loading as loading

    loads = []
    monkeypatch.setattr(loading, "load_model", lambda mcfg, *a, **k: loads.append(mcfg.path) or Head(9))
    out = beside_base.compare_with_base(SHARED_TOKENIZER, BASE, Head(5), None, [], BOTH, torch.device("cpu"))
    why = "the base model's vocabulary has 9 entries and the trained model's 5"
    assert out == {"sparse_selection": {"base": "base", "max_tokens": 7, "error": why},
                   "kl_to_base": {"temperature": 0.8, "error": why}}
    assert loads == ["base/path"]


def test_different_tokenizers_load_no_base(monkeypatch):
    import anabranch.models.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda mcfg: SimpleNamespace(get_vocab=lambda: {"a": 0}))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a base that cannot be compared"))
    trained_tok = SimpleNamespace(get_vocab=lambda: {"b": 0})
    out = beside_base.compare_with_base(CFG, BASE, Head(5), trained_tok, [], BOTH, torch.device("cpu"))
    assert "tokenizers differ" in out["sparse_selection"]["error"] and "tokenizers differ" in out["kl_to_base"]["error"]


def test_out_of_memory_loading_the_base_keeps_an_error_entry_for_each(monkeypatch):
    import anabranch.models.loading as loading

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(loading, "load_model", oom)
    out = beside_base.compare_with_base(SHARED_TOKENIZER, BASE, Head(5), None, [], BOTH, torch.device("cpu"))
    assert "out of memory" in out["sparse_selection"]["error"] and "--sparse-tokens 0" in out["sparse_selection"]["error"]
    assert "out of memory" in out["kl_to_base"]["error"] and "without --bon-frontier" in out["kl_to_base"]["error"]


def test_nothing_asked_loads_nothing(monkeypatch):
    import anabranch.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a base for no analysis"))
    off = EvalSettings(n=2, sparse_tokens=0, bon_frontier=False)
    assert beside_base.compare_with_base(SHARED_TOKENIZER, BASE, Head(5), None, [], off, torch.device("cpu")) == {}
