"""The first failed entry of a section's range-check table, as the refusal text the config checks raise.

Each method's check function lists ``(ok, key, why)`` rows for the keys of its config section; one loop
here turns the first row that fails into ``"<section>.<key> <why> (got <value>)"``, so every method's
refusal reads the same way (config_checks.py runs the functions at load and at train() start)."""

from __future__ import annotations

from typing import Any, Iterable


def first_failed(checks: Iterable[tuple[bool, str, str]], section: str, values: Any) -> str | None:
    """The refusal text of the first ``(ok, key, why)`` row with ``ok`` false (``values`` holds the keys), or None."""
    for ok, key, why in checks:
        if not ok:
            return f"{section}.{key} {why} (got {getattr(values, key)!r})"
    return None
