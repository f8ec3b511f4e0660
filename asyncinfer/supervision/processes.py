"""Child processes: is one alive, and stopping one by its PID (a signal, then SIGKILL)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

__all__ = ["pid_alive", "stop_process", "die_with_parent"]

#: Linux prctl option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
                 grace_s: float = 15.0) -> int:
    """Send ``sig`` to ``proc``, wait up to ``grace_s``, then SIGKILL it; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``Popen``: the child gets ``sig`` when this process dies, even by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``), so no worker or Redis outlives its supervisor. None
    where the platform has no such thing."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: go now
            os.kill(os.getpid(), sig)

    return preexec
