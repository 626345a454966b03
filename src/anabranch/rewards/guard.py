"""Calling a reward function so that it cannot take the trainer down.

A call runs with a deadline (``reward.timeout_s``):

* ``isolation="process"``: in a forked child process (its own process group) that is killed,
  with everything it started, at the deadline. Nothing is left running. The default for rewards
  that do not declare ``in_process=True`` (those that need the live policy or a loaded judge).
* ``isolation="thread"``: in a daemon worker thread. A hanging function is abandoned at the
  deadline (Python cannot kill a thread); its result is ignored. Used where fork is unavailable.

A call that raises, hangs past the deadline or returns the wrong number of values gives 0.0 for
every completion and counts one failure; with ``strict=True`` it raises :class:`RewardError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass, field


class RewardError(RuntimeError):
    """A reward function failed and ``reward.strict`` is set."""


@dataclass
class RewardOutput:
    """What a reward function may return instead of a plain list: values plus its own metrics."""

    values: list
    metrics: dict = field(default_factory=dict)


@dataclass
class GuardedResult:
    values: list[float]
    metrics: dict[str, float]
    failed: bool = False
    error: str = ""


def _normalize(raw, n: int) -> tuple[list[float], dict]:
    metrics = {}
    if isinstance(raw, RewardOutput):
        raw, metrics = raw.values, dict(raw.metrics)
    values = [float(v) for v in raw]
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    return values, {k: float(v) for k, v in metrics.items()}


def _child(conn, fn, args, kwargs, n):  # runs in the forked process
    os.setpgid(0, 0)
    try:
        conn.send(("ok", _normalize(fn(*args, **kwargs), n)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def _in_process(fn, args, kwargs, n, timeout):
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, kwargs, n), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise TimeoutError(f"timed out after {timeout:g} s")
        try:
            status, payload = recv.recv()
        except (EOFError, pickle.UnpicklingError) as exc:
            raise RuntimeError(f"worker process died ({exc.__class__.__name__})") from None
    finally:
        _kill_group(proc.pid)  # the group: anything the function started dies with it
        proc.join(5)
        recv.close()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def _in_thread(fn, args, kwargs, n, timeout):
    box: dict = {}

    def run():
        try:
            box["out"] = _normalize(fn(*args, **kwargs), n)
        except BaseException as exc:  # noqa: BLE001
            box["err"] = f"{type(exc).__name__}: {exc}"
            box["tb"] = traceback.format_exc()

    worker = threading.Thread(target=run, daemon=True, name="reward-worker")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"timed out after {timeout:g} s (the worker thread is abandoned)")
    if "err" in box:
        raise RuntimeError(box["err"])
    return box["out"]


def guarded_call(name: str, fn, args: tuple, kwargs: dict, n: int, *, timeout: float,
                 isolation: str = "process", strict: bool = False) -> GuardedResult:
    """Call ``fn(*args, **kwargs)`` (a reward for ``n`` completions) under a deadline."""
    if isolation == "process" and "fork" not in mp.get_all_start_methods():
        isolation = "thread"
    if isolation not in ("process", "thread", "none"):
        raise ValueError(f"reward isolation must be process, thread or none (got {isolation!r})")
    try:
        if isolation == "none":
            values, metrics = _normalize(fn(*args, **kwargs), n)
        else:
            runner = _in_process if isolation == "process" else _in_thread
            values, metrics = runner(fn, args, kwargs, n, timeout)
    except Exception as exc:  # noqa: BLE001 - a reward must never take the trainer down
        if strict:
            raise RewardError(f"reward {name!r} failed (reward.strict=true): {exc}") from exc
        return GuardedResult([0.0] * n, {}, failed=True, error=str(exc))
    return GuardedResult(values, metrics)
