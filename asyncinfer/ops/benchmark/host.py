"""This host: a process and everything it started, read from /proc (their PIDs and CPU seconds),
and a free port of 127.0.0.1.

Light on purpose (standard library only): the bench, its load generator and the peers' use it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

__all__ = ["tree_pids", "tree_cpu_s", "tree_system_cpu_s", "free_port"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text.rsplit(")", 1)[1].split()  # after "pid (comm)": fields from the state on


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it (children, their children, …)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds so far of ``root`` and its live descendants."""
    total = 0
    for pid in tree_pids(root):
        fields = _stat(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def tree_system_cpu_s(root: int) -> float:
    """The system (kernel) part of :func:`tree_cpu_s`: seconds spent in system calls and the
    work they do (a socket write, a wake-up of another thread or process)."""
    total = 0
    for pid in tree_pids(root):
        fields = _stat(pid)
        if fields is not None:
            total += int(fields[12])
    return total / _TICKS


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
