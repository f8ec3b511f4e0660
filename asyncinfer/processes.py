"""Child processes: is one alive, and stopping one by its PID (a signal, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["pid_alive", "stop_process"]


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
