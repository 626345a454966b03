"""Name -> function registries.

Every pluggable piece (advantage estimators, objectives, reward functions, tasks, rollout
backends) lives in a :class:`Registry`, so the trainer looks things up by the name in the
config instead of branching on it.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of callables with helpful errors on unknown names."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        """Decorator: ``@REG.register("grpo", needs=("ref_log_prob",))``."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            self._meta[name] = dict(meta)
            return obj

        return deco

    def get(self, name: str) -> T:
        if name in self._items:
            return self._items[name]
        if ":" in name:  # user's own "package.module:function"
            return load_object(name)
        raise KeyError(unknown_name_message(self.kind, name, self._items))

    def meta(self, name: str) -> dict[str, Any]:
        if name in self._meta:
            return self._meta[name]
        return dict(getattr(self.get(name), "anabranch_meta", {}))

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


def unknown_name_message(kind: str, name: str, choices) -> str:
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {name!r}.{hint} Known: {', '.join(choices)}"


def load_object(spec: str) -> Any:
    """Import ``package.module:attr`` and return the attribute, with clear errors."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module {module_name!r} named in {spec!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj
