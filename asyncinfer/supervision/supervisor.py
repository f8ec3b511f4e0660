"""Keeps a set of child processes running: restarts one that dies, stops all on request.

Children run in their own sessions, so a Ctrl-C reaches only the supervisor, which then stops
each child by its PID: SIGTERM (Celery's warm shutdown), then SIGKILL after a grace period.

A child's stderr passes through the supervisor, which keeps its last line: a child that exits
with :data:`CANNOT_START` (a worker that cannot start as configured) with the same last line
``max_start_failures`` times in a row is not started again, and the supervisor stops, reporting
that line (:attr:`Supervisor.failure`).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from asyncinfer.supervision.processes import die_with_parent

__all__ = ["Supervisor", "Child", "CANNOT_START"]

#: Exit status of a child that cannot start as configured (sysexits' EX_CONFIG): a worker's, a
#: gateway's (a port taken, say); starting it again as it is fails again.
CANNOT_START = 78

log = logging.getLogger(__name__)


@dataclass
class Child:
    """One supervised command."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    #: The last line the running (or last) process wrote on stderr.
    last_line: str = ""
    #: Consecutive exits with CANNOT_START and the same last line, and that line.
    start_failures: int = 0
    failure_line: str = ""
    reader: threading.Thread | None = field(default=None, repr=False)


class Supervisor:
    """Start children, restart the ones that exit, stop them all on :meth:`stop`."""

    def __init__(self, children: Sequence[Child], *, grace_s: float = 15.0,
                 max_backoff_s: float = 30.0, max_start_failures: int = 3) -> None:
        self.children = list(children)
        self.grace_s = grace_s
        self.max_backoff_s = max_backoff_s
        self.max_start_failures = max_start_failures
        #: ``(child name, its last line)`` once a child failed to start too often; run() returns.
        self.failure: tuple[str, str] | None = None
        self._stopping = threading.Event()

    def _start(self, child: Child) -> None:
        # A child stops with its supervisor even when that one is SIGKILLed (Linux).
        child.process = subprocess.Popen(list(child.argv), env=dict(child.env) if child.env else None,
                                         preexec_fn=die_with_parent(), stdin=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, start_new_session=True)
        child.last_line = ""
        assert child.process.stderr is not None
        child.reader = threading.Thread(target=_forward, args=(child, child.process.stderr),
                                        name=f"stderr of {child.name}", daemon=True)
        child.reader.start()
        log.info("started %s (pid %d)", child.name, child.process.pid)

    def start(self) -> None:
        """Start every child."""
        for child in self.children:
            self._start(child)

    def check(self) -> None:
        """Restart each child that exited, with exponential backoff between restarts."""
        now = time.monotonic()
        for child in self.children:
            proc = child.process
            if proc is not None and proc.poll() is None:
                continue
            if proc is not None:
                if child.reader is not None:
                    child.reader.join(timeout=2.0)  # its last line, written before it exited
                if self._gave_up(child, proc.returncode):
                    return
                child.restarts += 1
                delay = min(self.max_backoff_s, 0.5 * 2 ** min(child.restarts - 1, 10))
                log.warning("%s (pid %d) exited with %s; restarting in %.1f s",
                            child.name, proc.pid, proc.returncode, delay)
                child.process = None
                child.next_start = now + delay
            if now >= child.next_start:
                self._start(child)

    def _gave_up(self, child: Child, returncode: int | None) -> bool:
        """Count ``child``'s identical start failures; True (and stop) at the limit."""
        if returncode != CANNOT_START:
            child.start_failures, child.failure_line = 0, ""
            return False
        if child.last_line == child.failure_line:
            child.start_failures += 1
        else:
            child.start_failures, child.failure_line = 1, child.last_line
        if child.start_failures < self.max_start_failures:
            return False
        log.error("%s cannot start (%d times in a row, exit status %d); not starting it again",
                  child.name, child.start_failures, returncode)
        self.failure = (child.name, child.last_line)
        self.stop()
        return True

    def run(self, poll_s: float = 0.5) -> None:
        """Supervise until :meth:`stop` is called (from a signal handler, say)."""
        self.start()
        try:
            while not self._stopping.wait(poll_s):
                self.check()
                if self.failure is not None:
                    break
        finally:
            self.terminate()

    def stop(self) -> None:
        """Ask :meth:`run` to stop the children and return."""
        self._stopping.set()

    def terminate(self) -> None:
        """Stop every child by PID: SIGTERM, wait up to the grace period, then SIGKILL."""
        running = [c.process for c in self.children if c.process and c.process.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + self.grace_s
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop in %.0f s; killing it", proc.pid, self.grace_s)
                proc.kill()
                proc.wait()


def _forward(child: Child, stream: IO[bytes]) -> None:
    """Copy a child's stderr to ours, line by line, keeping its last non-empty line."""
    out = getattr(sys.stderr, "buffer", None)
    with stream:
        for raw in iter(stream.readline, b""):
            try:
                if out is not None:
                    out.write(raw)
                    out.flush()
                else:
                    sys.stderr.write(raw.decode(errors="replace"))
            except (OSError, ValueError):  # our stderr is gone: keep reading, so the child never blocks
                pass
            line = raw.decode(errors="replace").strip()
            if line:
                child.last_line = line
