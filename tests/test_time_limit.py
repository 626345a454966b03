"""The main-thread time limit used around math-verify's parsers (anabranch.rewards.time_limit)."""

import signal
import sys
import time

import pytest

from anabranch.rewards.time_limit import TimeLimitExceeded, time_limit


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_loop_that_swallows_exceptions_is_still_stopped():
    t0 = time.perf_counter()
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.2):
            while time.perf_counter() - t0 < 10:
                try:
                    spin(0.01)
                except Exception:  # a library's broad except must not eat the timeout
                    pass
    assert time.perf_counter() - t0 < 2


class SlowDestructor:
    def __del__(self):
        spin(0.4)  # the deadline passes in here, where an exception cannot propagate


def test_a_tick_inside_a_destructor_is_not_reported_and_the_limit_still_holds():
    seen = []
    outer_hook, outer_handler = sys.unraisablehook, signal.getsignal(signal.SIGALRM)
    sys.unraisablehook = seen.append
    try:
        t0 = time.perf_counter()
        with pytest.raises(TimeLimitExceeded):
            with time_limit(0.1):
                obj = SlowDestructor()
                del obj  # the tick at 0.1 s lands in __del__ (ending it) and is dropped
                spin(10)  # the next tick stops this
        elapsed = time.perf_counter() - t0
        assert 0.1 <= elapsed < 2, elapsed
        assert not seen, [u.exc_value for u in seen]  # nothing reported as an ignored exception
        # The block restored what it replaced.
        assert sys.unraisablehook is seen.append or sys.unraisablehook == seen.append
        assert signal.getsignal(signal.SIGALRM) is outer_handler
    finally:
        sys.unraisablehook = outer_hook


def test_other_unraisable_exceptions_still_reach_the_outer_hook():
    seen = []
    outer_hook = sys.unraisablehook
    sys.unraisablehook = seen.append

    class Broken:
        def __del__(self):
            raise ValueError("from a destructor")

    try:
        with time_limit(5):
            obj = Broken()
            del obj
    finally:
        sys.unraisablehook = outer_hook
    assert len(seen) == 1 and isinstance(seen[0].exc_value, ValueError)


def test_a_block_within_its_time_is_untouched():
    with time_limit(5):
        spin(0.05)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
