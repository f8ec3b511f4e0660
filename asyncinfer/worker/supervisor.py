"""Keeps a set of child processes running: restarts one that dies, stops all on request.

Children run in their own sessions, so a Ctrl-C reaches only the supervisor, which then stops
each child by its PID: SIGTERM (Celery's warm shutdown), then SIGKILL after a grace period.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from asyncinfer.processes import die_with_parent

__all__ = ["Supervisor", "Child"]

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


class Supervisor:
    """Start children, restart the ones that exit, stop them all on :meth:`stop`."""

    def __init__(self, children: Sequence[Child], *, grace_s: float = 15.0,
                 max_backoff_s: float = 30.0) -> None:
        self.children = list(children)
        self.grace_s = grace_s
        self.max_backoff_s = max_backoff_s
        self._stopping = threading.Event()

    def _start(self, child: Child) -> None:
        # A child stops with its supervisor even when that one is SIGKILLed (Linux).
        child.process = subprocess.Popen(list(child.argv), env=dict(child.env) if child.env else None,
                                         preexec_fn=die_with_parent(),
                                         stdin=subprocess.DEVNULL, start_new_session=True)
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
                child.restarts += 1
                delay = min(self.max_backoff_s, 0.5 * 2 ** min(child.restarts - 1, 10))
                log.warning("%s (pid %d) exited with %s; restarting in %.1f s",
                            child.name, proc.pid, proc.returncode, delay)
                child.process = None
                child.next_start = now + delay
            if now >= child.next_start:
                self._start(child)

    def run(self, poll_s: float = 0.5) -> None:
        """Supervise until :meth:`stop` is called (from a signal handler, say)."""
        self.start()
        try:
            while not self._stopping.wait(poll_s):
                self.check()
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
