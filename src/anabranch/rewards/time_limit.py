"""A wall-clock limit for pure-Python work (parsers, verifiers) on the main thread.

math-verify's own limit is a one-shot ``signal.alarm``: when the alarm lands inside a destructor
or a library's broad ``except``, the timeout exception is swallowed and the parse runs on without
any limit (seen on adversarial LaTeX: 1 s limit, 78 s run). Here the timer re-fires every 50 ms
after the deadline, and the exception derives from ``BaseException`` so ``except Exception``
cannot eat it, until it reaches :func:`time_limit`'s caller.

Off the main thread signals cannot be used: there the block runs without a limit and the caller
must bound it (a worker process).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class TimeLimitExceeded(BaseException):
    """Raised inside a :func:`time_limit` block that ran past its deadline."""


@contextmanager
def time_limit(seconds: float | None):
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    state = {"active": True}

    def handler(signum, frame):
        if state["active"]:
            raise TimeLimitExceeded(f"over {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, handler)
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
