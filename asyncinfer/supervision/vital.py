"""Threads a worker cannot live without: if one dies, the process exits to be replaced.

A worker whose result writer, consumer or device thread has died but whose process lives on serves
nothing while looking healthy to its supervisor. Each of those threads runs its loop through
:func:`vital_thread`: an exception that escapes the loop (the loop itself survives every error it
expects, such as Redis refusing writes) is logged with its traceback and the process exits with
:data:`EXIT_THREAD_DIED`, so that ``asyncinfer up``, systemd or Kubernetes starts a fresh one. What
the process held is unacknowledged, and kombu's bookkeeping redelivers it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_THREAD_DIED", "vital_thread"]

log = logging.getLogger(__name__)

#: Exit status of a worker process that lost a vital thread (EX_SOFTWARE).
EXIT_THREAD_DIED = 70


def vital_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A daemon thread running ``target(*args)``; if it raises, the whole process exits."""

    def run() -> None:
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the process cannot serve
            log.critical("thread %s died (%s: %s); this worker process exits with status %d to be "
                         "replaced", name, type(exc).__name__, exc, EXIT_THREAD_DIED, exc_info=True)
            logging.shutdown()
            os._exit(EXIT_THREAD_DIED)

    return threading.Thread(target=run, name=name, daemon=True)
