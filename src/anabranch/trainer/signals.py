"""SIGINT/SIGTERM during training: the first asks the loop to stop after the current step (it
then writes a checkpoint and exits with the command that resumes); a second one stops at once."""

from __future__ import annotations

import signal
import sys
import threading


class RunStopped(RuntimeError):
    """The run stopped early on purpose (a signal, too many non-finite steps); ``str()`` says why
    and how to go on. ``exit_code`` is what the command line returns."""

    def __init__(self, message: str, checkpoint=None, exit_code: int = 1):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.exit_code = exit_code


class GracefulStop:
    """Context manager that installs the handlers (main thread only) and restores the old ones."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        # Until the loop is ready to train (models loading, no step to finish) a signal stops at once.
        self.training = False
        self._old: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if not self.training:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} before training started")
        if self.signum is not None:
            # Second signal: no more waiting. Checkpoints are atomic, so the last one stays whole.
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")
        self.signum = signum
        print(f"\nanabranch: {signal.Signals(signum).name} received: finishing the current step, then "
              "writing a checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
