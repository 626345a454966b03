"""The user's own data: JSONL, JSON, parquet, CSV, a saved Hugging Face dataset or a Hub id.

Every row must have a prompt column and an answer column (names configurable); a missing
file, a missing column or an empty dataset raises :class:`DataError` naming it.
"""

from __future__ import annotations

from pathlib import Path

from anabranch.config import ConfigError


class DataError(ConfigError):
    """Unusable data, reported before training starts."""


def load_rows(path: str, split: str = "train") -> list[dict]:
    """Read all rows of ``path`` as plain dicts."""
    if path.startswith("hf:"):
        return _load_hub(path[3:], split)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"dataset file not found: {p}")
    if p.is_dir():
        return _load_saved_dataset(p, split)
    suffix = p.suffix.lower()
    import datasets

    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    if suffix not in builders:
        raise DataError(f"dataset file {p} has an unsupported extension {suffix!r}; use one of {sorted(builders)}")
    try:
        ds = datasets.load_dataset(builders[suffix], data_files=str(p), split="train")
    except Exception as exc:  # datasets raises many types for malformed files
        raise DataError(f"cannot read dataset file {p}: {exc}") from exc
    return [dict(r) for r in ds]


def _load_saved_dataset(p: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:
        raise DataError(f"{p} is a folder but not a dataset saved with save_to_disk: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"dataset {p} has no split {split!r}; splits: {list(ds)}")
        ds = ds[split]
    return [dict(r) for r in ds]


def _load_hub(name: str, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:
        raise DataError(f"cannot load Hugging Face dataset {name!r} split {split!r}: {exc}") from exc
    return [dict(r) for r in ds]


def check_columns(rows: list[dict], source: str, prompt_column: str, answer_column: str) -> list[dict]:
    """Rename the configured columns to ``question``/``answer``; fail clearly when absent."""
    if not rows:
        raise DataError(f"dataset {source} is empty")
    out = []
    for i, row in enumerate(rows):
        for col, key in ((prompt_column, "task.prompt_column"), (answer_column, "task.answer_column")):
            if col not in row:
                raise DataError(
                    f"dataset {source} row {i} has no column {col!r} (set {key}); columns: {sorted(row)}"
                )
        item = dict(row)
        item["question"] = row[prompt_column]
        item["answer"] = row[answer_column] if row[answer_column] is None else str(row[answer_column])
        out.append(item)
    return out
