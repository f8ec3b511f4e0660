"""Giving a model's memory back after it is unloaded (or after a load that failed): Python's
garbage, the accelerator's cached blocks, and the C heap's free pages.

torch keeps freed device memory cached for its next allocations, so an unloaded model would still
hold the device's memory as the driver sees it: its cache is emptied. On the host, glibc keeps
freed heap pages (blocks under its mmap threshold, which grows to 32 MiB as large blocks are
freed) for the process: ``malloc_trim`` hands them back, so the worker's resident size falls.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from typing import Any

import torch

__all__ = ["free_memory"]

log = logging.getLogger(__name__)


def _libc() -> Any:
    # the process' own symbols (libc's among them): find_library would run ldconfig at import
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def free_memory(device: Any) -> None:
    """Collect garbage, empty ``device``'s allocator cache (an accelerator's), trim the heap."""
    gc.collect()
    if getattr(device, "is_accelerator", False):
        kind = device.torch_device.type
        module = getattr(torch, kind, None)
        empty = getattr(module, "empty_cache", None)
        if empty is not None:
            try:
                empty()
            except Exception as exc:  # noqa: BLE001 - the memory stays cached; nothing breaks
                log.warning("could not empty the %s allocator cache (%s)", kind, exc)
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
