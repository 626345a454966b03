"""Steps of two systems run in turns, one step at a time, each system in its own live process.

This host's speed drifts by ±15% within minutes (docs/benchmarks.md). Running all of one system's
steps, then all of the other's, puts minutes between the steps compared, so the ratio carries the
drift. Here both worker processes stay alive (each keeps its own model, engine and peak RSS), and
the parent lets one step run at a time, in the order A B, B A, A B, ...: step *i* of both systems
runs within a minute, under the same conditions, and the ratio of each pair reads the systems, not
the host.

The protocol, over the worker's stdin and stdout: before each step the worker prints ``READY`` and
waits for a line ``go`` (:func:`wait_for_turn`); after its last step it prints its ``RESULT`` line. The
parent (:class:`GatedWorker`) starts a worker, reads until ``READY`` (its start-up is done), and
:meth:`GatedWorker.step` sends ``go`` and reads until the next ``READY`` or ``RESULT``: one step,
done. It also reads the waiting worker's CPU time around the other's step (``idle_cpu_s``), which
shows that a waiting worker takes no CPU from a running one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

READY, GO, RESULT = "READY", "go", "RESULT "


def wait_for_turn() -> None:
    """Worker side, before each step: say ``READY`` and wait for the parent's ``go``."""
    print(READY, flush=True)
    line = sys.stdin.readline()
    if line.strip() != GO:
        raise SystemExit(f"step gate: expected {GO!r} from the parent, got {line!r}")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class GatedWorker:
    """Parent side: one worker process whose steps run when :meth:`step` says so."""

    def __init__(self, name: str, cmd: list[str]):
        self.name = name
        self.stderr = tempfile.TemporaryFile(mode="w+")
        # its own session: the pause and the kill reach its helper processes too (Inductor's compile workers)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1, start_new_session=True)
        self.tail: list[str] = []
        self.result: str | None = None
        if self._read_until_marker() != READY:
            self._fail("ended before its first step")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _read_until_marker(self) -> str | None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line == READY:
                return READY
            if line.startswith(RESULT):
                self.result = line[len(RESULT):]
                return RESULT
            self.tail = (self.tail + [line])[-50:]
        return None

    def _fail(self, why: str):
        self.kill()
        self.stderr.seek(0)
        sys.stderr.write("\n".join(self.tail) + "\n" + self.stderr.read()[-8000:])
        raise SystemExit(f"{self.name} worker {why} (exit {self.proc.returncode})")

    def step(self) -> None:
        """Run one step of this worker and return when it is done: stopped again before its next
        step, or exited after its last."""
        if self.result is not None:
            raise RuntimeError(f"{self.name} worker has no steps left")
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(GO + "\n")
        self.proc.stdin.flush()
        marker = self._read_until_marker()
        if marker is None:
            self._fail("ended without a result")
        if marker == READY:
            self._signal(signal.SIGSTOP)
        else:
            self.proc.wait()

    def kill(self) -> None:
        """End the worker and its helpers, whatever they are doing."""
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait()

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)

    def finish(self) -> dict:
        """The worker's RESULT, once its last step has run."""
        if self.result is None:
            raise RuntimeError(f"{self.name} worker has steps left")
        self.proc.wait()
        return json.loads(self.result)


def start_in_turn(commands: dict[str, list[str]]) -> list[GatedWorker]:
    """Start the workers one after the other (their start-ups do not overlap), each stopped once
    ready; if one fails, the ones already started are ended."""
    workers: list[GatedWorker] = []
    try:
        for name, cmd in commands.items():
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            workers.append(GatedWorker(name, cmd))
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


def run_in_turns(workers: list[GatedWorker], steps: int) -> tuple[list[dict], dict[str, float]]:
    """Run ``steps`` steps of every worker, one step at a time, the order reversed every round (A B,
    B A, ...). Returns the workers' results and, per worker, the most CPU time it took while it
    waited during another's step."""
    idle = {w.name: 0.0 for w in workers}
    try:
        for i in range(steps):
            for w in workers if i % 2 == 0 else workers[::-1]:
                others = [(o, o.cpu_s()) for o in workers if o is not w and o.result is None]
                w.step()
                for o, c in others:
                    idle[o.name] = max(idle[o.name], o.cpu_s() - c)
        return [w.finish() for w in workers], idle
    finally:  # an error or Ctrl-C here must not leave stopped workers holding their memory
        for w in workers:
            w.kill()
