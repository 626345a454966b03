"""Calling a reward function so that it cannot take the trainer down.

A call runs with a deadline (``reward.timeout_s``):

* ``isolation="process"``: in a forked child process (its own process group) that is killed,
  with everything it started, at the deadline. Nothing is left running. The default for rewards
  that do not declare ``in_process=True`` (those that need the live policy or a loaded judge).
* ``isolation="thread"``: in a daemon worker thread. A hanging function is abandoned at the
  deadline (Python cannot kill a thread); its result is ignored. Used where fork is unavailable.

A call that raises, hangs past the deadline or returns the wrong number of values gives 0.0 for
every completion and counts one failure; with ``strict=True`` it raises :class:`RewardError`.

Failures are also said on the console (``anabranch: warning: reward '<name>' failed (<kind>):
<exception>``, the channel of the trainer's other warnings) by a :class:`FailureLog` per reward
source: the first failure, a failure that differs from those already shown (a few per source),
and then one reminder every :data:`WARN_EVERY` failures, each with the count so far.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

# Kinds of failure, as the warnings name them.
RAISED = "raised"
TIMED_OUT = "timed out"
BAD_OUTPUT = "bad return value"
WORKER_DIED = "worker died"
NOT_RUN = "could not run"
MISSING_FIELDS = "missing fields"

WARN_EVERY = 100  # a failure already shown is shown again every this many failures of its source
MAX_DISTINCT = 5  # distinct failures (kind + message) of one source shown as they first appear
_MAX_MESSAGE = 500


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
    kind: str = ""


def warn(text: str) -> None:
    """``anabranch: warning: <text>`` where the trainer's other warnings go (``tqdm.write``: stdout,
    above the progress bar)."""
    line = f"anabranch: warning: {text}"
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        print(line, file=sys.stderr, flush=True)
    else:
        tqdm.write(line)


class FailureLog:
    """One reward source's calls and failures, and when to warn about them on the console.

    Warns on the first failure, on a failure whose kind or message has not been shown yet (up to
    ``max_distinct`` of them), and otherwise once every ``every`` failures; each warning names the
    source, the kind of failure and the exception, with the failures and calls so far.
    """

    def __init__(self, name: str, every: int | None = None, max_distinct: int | None = None, write=None):
        self.name = name
        self.every = max(1, int(every if every is not None else WARN_EVERY))
        self.max_distinct = max_distinct if max_distinct is not None else MAX_DISTINCT
        self.write = write or warn
        self.calls = 0
        self.failures = 0
        self.shown: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def __getstate__(self):  # copyable and picklable with its source: the lock is not
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def succeeded(self) -> None:
        with self._lock:
            self.calls += 1

    def failed(self, kind: str, error: str) -> str | None:
        """Count a failure; return (and write) the warning if this one is to be shown."""
        with self._lock:
            self.calls += 1
            self.failures += 1
            first = self.failures == 1
            new = (kind, error) not in self.shown and len(self.shown) < self.max_distinct
            if not (first or new or self.failures % self.every == 0):
                return None
            self.shown.add((kind, error))
            text = (f"reward {self.name!r} failed ({kind}): {error}; its values are 0.0 for this batch "
                    f"({self.failures} failure{'s' if self.failures != 1 else ''} in {self.calls} "
                    f"call{'s' if self.calls != 1 else ''} so far")
            if first:
                text += (f"; further failures are shown when they differ and at every {self.every}th, "
                         f"all are counted in reward/{self.name}/failures")
            text += ")"
        self.write(text)
        return text


def _describe(exc: BaseException, where: bool = False) -> str:
    """``Type: message`` (the traceback's last line, on one line), with where it was raised."""
    message = " ".join(str(exc).split())
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if where and exc.__traceback__ is not None:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            text += f" (at {os.path.basename(last.filename)}:{last.lineno}, in {last.name})"
    return text


class _Failed(Exception):
    """A reward call failed; ``kind`` is one of the kinds above, ``detail`` says how."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class _BadOutput(ValueError):
    pass


def _normalize(raw, n: int) -> tuple[list[float], dict]:
    metrics = {}
    if isinstance(raw, RewardOutput):
        raw, metrics = raw.values, dict(raw.metrics)
    try:
        values = [float(v) for v in raw]
        metrics = {k: float(v) for k, v in metrics.items()}
    except (TypeError, ValueError) as exc:
        raise _BadOutput(f"the returned values are not a list of numbers ({_describe(exc)})") from None
    if len(values) != n:
        raise _BadOutput(f"returned {len(values)} values for {n} completions")
    return values, metrics


def _call(fn, args, kwargs, n):
    """``("ok", (values, metrics))`` or ``(kind, detail, exception)``; lets BaseException through."""
    try:
        raw = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        return RAISED, _describe(exc, where=True), exc
    try:
        return "ok", _normalize(raw, n)
    except _BadOutput as exc:
        return BAD_OUTPUT, str(exc), exc


def _child(conn, fn, args, kwargs, n):  # runs in the forked process
    os.setpgid(0, 0)
    try:
        conn.send(_call(fn, args, kwargs, n)[:2])
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        conn.send((RAISED, _describe(exc, where=True)))
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
            raise _Failed(TIMED_OUT, f"no result after {timeout:g} s (the worker process was killed)")
        try:
            status, payload = recv.recv()
        except (EOFError, pickle.UnpicklingError) as exc:
            raise _Failed(WORKER_DIED, f"the worker process ended without a result ({exc.__class__.__name__})") \
                from None
    finally:
        _kill_group(proc.pid)  # the group: anything the function started dies with it
        proc.join(5)
        recv.close()
    if status != "ok":
        raise _Failed(status, payload)
    return payload


# The deadline of the reward call running on this thread (thread isolation only): an abandoned call
# cannot be killed, but a long one can see that it was abandoned and stop (deadline_passed).
_call_deadline = threading.local()


def deadline_passed() -> bool:
    """True inside a reward call under thread isolation once the guard has given up on it. A reward
    that works in units (batches) and holds something shared checks it between units and stops: an
    abandoned call would otherwise hold it for the rest of its work, and the next call would wait."""
    at = getattr(_call_deadline, "at", None)
    return at is not None and time.monotonic() > at


def _in_thread(fn, args, kwargs, n, timeout):
    box: dict = {}

    def run():
        _call_deadline.at = time.monotonic() + timeout
        try:
            box["out"] = _call(fn, args, kwargs, n)
        except BaseException as exc:  # noqa: BLE001
            box["out"] = (RAISED, _describe(exc, where=True), exc)

    worker = threading.Thread(target=run, daemon=True, name="reward-worker")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _Failed(TIMED_OUT, f"no result after {timeout:g} s (the worker thread is abandoned)")
    if box["out"][0] != "ok":
        kind, detail, exc = box["out"]
        raise _Failed(kind, detail) from exc
    return box["out"][1]


def _inline(fn, args, kwargs, n, timeout):
    out = _call(fn, args, kwargs, n)
    if out[0] != "ok":
        kind, detail, exc = out
        raise _Failed(kind, detail) from exc
    return out[1]


def guarded_call(name: str, fn, args: tuple, kwargs: dict, n: int, *, timeout: float,
                 isolation: str = "process", strict: bool = False,
                 log: FailureLog | None = None) -> GuardedResult:
    """Call ``fn(*args, **kwargs)`` (a reward for ``n`` completions) under a deadline.

    A failure is counted in ``log`` (the source's :class:`FailureLog`, which keeps the counts across
    calls; a fresh one if not given), which warns on the console as it says.
    """
    if isolation == "process" and "fork" not in mp.get_all_start_methods():
        isolation = "thread"
    if isolation not in ("process", "thread", "none"):
        raise ValueError(f"reward isolation must be process, thread or none (got {isolation!r})")
    log = log if log is not None else FailureLog(name)
    runner = {"process": _in_process, "thread": _in_thread, "none": _inline}[isolation]
    try:
        values, metrics = runner(fn, args, kwargs, n, timeout)
    except Exception as exc:  # noqa: BLE001 - a reward must never take the trainer down
        kind, detail = (exc.kind, exc.detail) if isinstance(exc, _Failed) else (NOT_RUN, _describe(exc))
        if strict:
            raise RewardError(f"reward {name!r} failed (reward.strict=true; {kind}): {detail}") from exc
        log.failed(kind, detail)
        return GuardedResult([0.0] * n, {}, failed=True, error=detail, kind=kind)
    log.succeeded()
    return GuardedResult(values, metrics)
