"""The gateway's file descriptors: its open-files limit raised at start, and the connection caps
derived from it.

Every connection a gateway holds is a descriptor; so is every Redis connection, log file and
module it reads. Under the common soft limit of 1,024, a thousand idle callers once took them
all: every accept failed, every new caller timed out. The soft limit may be raised by the process
itself up to the hard limit (often far higher), so the gateway does at start. What is left is
shared by caps, so that the fronts refuse connections cleanly before the descriptors run out,
with a reserve for what is not a caller's connection.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = ["raise_open_files_limit", "Caps", "connection_caps", "RESERVE_FILES"]

log = logging.getLogger(__name__)

#: Descriptors kept back from the connection caps: Redis connections (a pool per thread of the
#: gateway's executor, and the result watcher), files, the listening sockets, epoll, and the
#: connections asyncio accepts in one pass (up to the listen backlog, 128) before the HTTP cap
#: sees them. At least this many, or an eighth of the limit; at most half of a small limit.
RESERVE_FILES = 256
#: Where Linux says the most a limit may be when the hard limit is "unlimited".
_NR_OPEN = Path("/proc/sys/fs/nr_open")


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; log before and after,
    once; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(_NR_OPEN.read_text())
        except (OSError, ValueError):
            target = soft
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("open-files limit stays at %d: raising it to %d failed: %s", soft, target,
                        exc)
            return soft
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    log.info("open-files limit: soft %d -> %d (hard %s)", soft, now, shown_hard)
    return int(now)


@dataclass(frozen=True)
class Caps:
    """The most connections each front holds open."""

    http: int
    grpc: int


def connection_caps(open_files: int, max_connections: int = 0) -> Caps:
    """The caps for a process that may open ``open_files`` descriptors.

    ``max_connections`` (``ASYNCINFER_GATEWAY_MAX_CONNECTIONS``), when set, is each front's cap
    as given. Otherwise the limit less the reserve (at least ``RESERVE_FILES`` or an eighth of the
    limit, at most half of it) is split: three quarters to HTTP, a quarter to gRPC (at least one
    each)."""
    if max_connections > 0:
        return Caps(max_connections, max_connections)
    reserve = max(min(RESERVE_FILES, open_files // 2), open_files // 8)
    budget = max(2, open_files - reserve)
    grpc = max(1, budget // 4)
    return Caps(http=max(1, budget - grpc), grpc=grpc)
