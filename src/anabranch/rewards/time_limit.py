"""A wall-clock limit for pure-Python work (parsers, verifiers) on the main thread.

math-verify's own limit is a one-shot ``signal.alarm``: when the alarm lands inside a destructor
or a library's broad ``except``, the timeout exception is swallowed and the parse runs on without
any limit (seen on adversarial LaTeX: 1 s limit, 78 s run). Here the timer re-fires every 50 ms
after the deadline, and the exception derives from ``BaseException`` so ``except Exception``
cannot eat it, until it reaches :func:`time_limit`'s caller.

A tick that lands in a destructor or a garbage-collector callback cannot propagate: Python hands
it to ``sys.unraisablehook``. Inside the block that hook is wrapped so that our own timeout is
dropped there (the next tick raises it where it can propagate) instead of being reported as an
error, and so that no tick lands while the hook itself runs (seen under pytest: a tick inside its
unraisable-exception hook turned a timed-out parse into a test failure).

Off the main thread signals cannot be used: there the block runs without a limit and the caller
must bound it (a worker process).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager


class TimeLimitExceeded(BaseException):
    """Raised inside a :func:`time_limit` block that ran past its deadline."""


@contextmanager
def time_limit(seconds: float | None):
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    state = {"active": True, "in_hook": 0}

    def handler(signum, frame):
        if state["active"] and not state["in_hook"]:
            raise TimeLimitExceeded(f"over {seconds} s")

    outer_hook = sys.unraisablehook

    def unraisable_hook(unraisable):
        if isinstance(unraisable.exc_value, TimeLimitExceeded):
            return  # a tick that hit a destructor or gc callback; the next one propagates
        state["in_hook"] += 1
        try:
            outer_hook(unraisable)
        finally:
            state["in_hook"] -= 1

    old_handler = signal.signal(signal.SIGALRM, handler)
    sys.unraisablehook = unraisable_hook
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    finally:
        try:
            state["active"] = False
        finally:  # reached even if a last tick raised on the line above
            state["active"] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            sys.unraisablehook = outer_hook
