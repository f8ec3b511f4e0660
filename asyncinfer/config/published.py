"""Where ``asyncinfer up`` publishes its embedded broker's URL, for the settings (and the CLI)
of every process on the host to find it without configuration (ops/redis_server.py writes it)."""

from __future__ import annotations

from pathlib import Path

from asyncinfer.supervision.processes import pid_alive

__all__ = ["URL_FILE", "PID_FILE", "published_url"]

#: The published broker URL and the PID of the Redis serving it, in ``asyncinfer up``'s folder.
URL_FILE = "broker_url"
PID_FILE = "redis.pid"


def published_url(state_dir: Path) -> str | None:
    """The broker URL an ``asyncinfer up`` on this host published, if its Redis still runs."""
    try:
        url = (state_dir / URL_FILE).read_text().strip()
        pid = int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return url if url and pid_alive(pid) else None
