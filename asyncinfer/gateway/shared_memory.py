"""Triton's system shared-memory extension: a same-host caller's tensors through POSIX shared
memory instead of the request and response bodies.

A client creates a POSIX shared-memory object (``shm_open``: a key such as ``/input_simple``),
registers a *region* of it under a name (``POST /v2/systemsharedmemory/region/<name>/register``
``{"key", "offset", "byte_size"}``, gRPC ``SystemSharedMemoryRegister``), then names the region in
an input's or output's parameters (``shared_memory_region``, ``shared_memory_offset``,
``shared_memory_byte_size``): the gateway reads that input's bytes from the region, and writes
that output's bytes into it instead of the response. Status and unregister as Triton's.

The gateway opens the region's object (it must be on the gateway's host: a key the gateway cannot
open is refused with Triton's "Unable to open shared memory region" and why) and reads and writes
it with pread / pwrite, never a mapping: an object its owner shrinks is refused, where touching a
mapping past its new end would kill the gateway (SIGBUS). The bytes go on to the
worker in the request as any input's do (the worker may be on another host). As Triton since
2.56, registering is refused unless the gateway's operator allows it (``--allow-client-shm``,
``ASYNCINFER_ALLOW_CLIENT_SHM``): a registered key gives its caller read and write access to that
shared-memory object as the gateway's user. Regions belong to one gateway process: with
``--processes N`` above 1 a registration could land on one process and the infer call on another,
so registering is refused there, saying so.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.wire.envelope import printable

__all__ = ["SharedMemory", "Region", "REGION", "OFFSET", "BYTE_SIZE", "DISABLED", "shm_reference"]

REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"

#: Triton's words when client shared memory is off (then how to turn it on here).
DISABLED = ("Client shared memory is disabled. Start the server with '--allow-client-shm=true' to "
            "enable. (asyncinfer: start the gateway with --allow-client-shm, or set "
            "ASYNCINFER_ALLOW_CLIENT_SHM=1)")

#: A POSIX shared-memory name: one leading slash, then no slash (shm_open's portable form).
_KEY = re.compile(r"/[^/\x00]{1,254}")


@dataclass
class Region:
    """A registered region: ``byte_size`` bytes at ``offset`` of the object ``key``, mapped."""

    name: str
    key: str
    offset: int
    byte_size: int
    #: The object's descriptor, read and written with pread / pwrite (not mapped: an object its
    #: owner shrinks under a mapping makes an access past its end a SIGBUS, which kills the
    #: process; a read past the end of a descriptor is only short).
    _fd: int = field(default=-1, repr=False)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def check_size(self, where: str) -> None:
        """Raise GatewayError when the object no longer holds the whole region (shrunk by its
        owner since it was registered): reading or writing there would kill the process."""
        size = os.fstat(self._fd).st_size if self._fd >= 0 else 0
        if size < self.offset + self.byte_size:
            raise GatewayError(400, f"{where}: shared memory region '{printable(self.name, 60)}' "
                                    f"no longer fits its object '{printable(self.key, 60)}': "
                                    f"the object holds {size} bytes, the region was registered "
                                    f"at {self.offset} + {self.byte_size}; unregister and "
                                    f"register it again")


def shm_reference(where: str, parameters: dict[str, Any]) -> tuple[str, int, int] | None:
    """``(region, offset, byte_size)`` of a tensor's parameters, None when it names no region.

    Raises:
        GatewayError: 400, a region without its byte size (or a size without a region), or a
            value of the wrong type.
    """
    region, offset, size = parameters.get(REGION), parameters.get(OFFSET, 0), parameters.get(BYTE_SIZE)
    if region is None:
        if size is not None or OFFSET in parameters:
            raise GatewayError(400, f"{where}: '{BYTE_SIZE}' or '{OFFSET}' without "
                                    f"'{REGION}'; give the region's name too")
        return None
    if not isinstance(region, str) or not region:
        raise GatewayError(400, f"{where}: '{REGION}' must be a region's name (a string)")
    if size is None:
        raise GatewayError(400, f"{where}: '{REGION}' needs '{BYTE_SIZE}' (Triton: both are "
                                f"required)")
    for name, value in ((OFFSET, offset), (BYTE_SIZE, size)):
        if type(value) is not int or value < 0:
            raise GatewayError(400, f"{where}: '{name}' must be a non-negative integer, got "
                                    f"{printable(repr(value), 40)}")
    return region, offset, size


class SharedMemory:
    """The gateway process' registered system shared-memory regions.

    ``allowed``: registering is allowed (``--allow-client-shm``); ``processes``: how many gateway
    processes share the ports (above 1, registering is refused: regions are per process).
    """

    def __init__(self, *, allowed: bool, processes: int = 1) -> None:
        self.allowed = allowed
        self.processes = processes
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the shared-memory object ``key`` as
        ``name``.

        Raises:
            GatewayError: not allowed; already registered; a key that is not a POSIX shared-memory
                name or that cannot be opened on this host; a region past the object's end.
        """
        self.check_allowed()
        if not name:
            raise GatewayError(400, "'region name' is necessary to register system shared memory "
                                    "region")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise GatewayError(400, f"failed to register shared memory region "
                                        f"'{printable(name, 60)}': '{what}' must be a "
                                        f"non-negative integer, got {printable(repr(value), 40)}")
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise GatewayError(400, f"Unable to open shared memory region: "
                                    f"'{printable(key, 60)}' (a key is a POSIX shared-memory "
                                    f"name: '/' then a name without '/')")
        with self._lock:
            if name in self._regions:
                raise GatewayError(400, f"shared memory region '{printable(name, 60)}' already in "
                                        f"manager", grpc_code="ALREADY_EXISTS")
            region = Region(name, key, offset, byte_size)
            _open_region(region)
            self._regions[name] = region

    def unregister(self, name: str = "") -> None:
        """Unregister ``name`` ("" for every region); an unknown name is not an error (Triton's)."""
        self.check_allowed()
        with self._lock:
            gone = list(self._regions) if not name else [name] if name in self._regions else []
            for each in gone:
                self._regions.pop(each).close()

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """The status of ``name`` ("" for every region).

        Raises:
            GatewayError: 404, no region of that name.
        """
        with self._lock:
            if not name:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise GatewayError(404, f"Unable to find system shared memory region: "
                                    f"'{printable(name, 60)}'")
        return [region.status()]

    def check(self, where: str, name: str, offset: int, byte_size: int) -> None:
        """Raise GatewayError unless ``byte_size`` bytes at ``offset`` of region ``name`` are
        there (an output's place, checked before its request is sent)."""
        with self._lock:
            self._find(where, name, offset, byte_size)

    def read(self, where: str, name: str, offset: int, byte_size: int) -> bytes:
        """A copy of ``byte_size`` bytes at ``offset`` of region ``name`` (an input's data)."""
        with self._lock:
            region, start = self._find(where, name, offset, byte_size)
            data = os.pread(region._fd, byte_size, start)
        if len(data) < byte_size:  # shrunk since the size was checked
            region.check_size(where)
        return data

    def write(self, where: str, name: str, offset: int, byte_size: int, data: bytes) -> None:
        """Write ``data`` (an output's bytes) at ``offset`` of region ``name``, whose caller gave
        it ``byte_size`` bytes.

        Raises:
            GatewayError: the output does not fit the bytes given (Triton's words).
        """
        if len(data) > byte_size:
            raise GatewayError(400, f"{where}: shared memory size specified with the request for "
                                    f"output ({byte_size} bytes) should be at least {len(data)} "
                                    f"bytes to hold the results")
        with self._lock:
            region, start = self._find(where, name, offset, byte_size)
            os.pwrite(region._fd, data, start)

    def close(self) -> None:
        with self._lock:
            for region in self._regions.values():
                region.close()
            self._regions.clear()

    def check_allowed(self) -> None:
        """Raise GatewayError unless registering is allowed here (Triton's words, then how)."""
        if not self.allowed:
            raise GatewayError(400, DISABLED, grpc_code="UNIMPLEMENTED")
        if self.processes > 1:
            raise GatewayError(400, f"system shared memory is served by a gateway of one process; "
                                    f"this one runs {self.processes} (--processes): a region "
                                    f"registered with one would be unknown to the others",
                               grpc_code="UNIMPLEMENTED")

    def _find(self, where: str, name: str, offset: int, byte_size: int) -> tuple[Region, int]:
        region = self._regions.get(name)
        if region is None:
            raise GatewayError(400, f"{where}: Unable to find system shared memory region: "
                                    f"'{printable(name, 60)}'")
        if byte_size and offset >= region.byte_size:
            raise GatewayError(400, f"{where}: Invalid offset for shared memory region: "
                                    f"'{printable(name, 60)}'")
        if offset + byte_size > region.byte_size:
            raise GatewayError(400, f"{where}: Invalid offset + byte size for shared memory "
                                    f"region: '{printable(name, 60)}' ({offset} + {byte_size} "
                                    f"bytes, the region has {region.byte_size})")
        region.check_size(where)
        return region, region.offset + offset


def _open_region(region: Region) -> None:
    """Open ``region``'s object (read and write), checking the region lies within it."""
    try:
        fd = _shm_open(region.key)
    except OSError as exc:
        raise GatewayError(400, f"Unable to open shared memory region: '{printable(region.key, 60)}' "
                                f"({exc.strerror or exc}; the region must be in this gateway's "
                                f"host's shared memory: a client on another host cannot use "
                                f"it)") from None
    try:
        size = os.fstat(fd).st_size
        if region.offset + region.byte_size > size:
            raise GatewayError(400, f"failed to register shared memory region "
                                    f"'{printable(region.name, 60)}': invalid args (offset "
                                    f"{region.offset} + byte_size {region.byte_size} is past the "
                                    f"end of '{printable(region.key, 60)}', {size} bytes)")
    except BaseException:
        os.close(fd)
        raise
    region._fd = fd


def _shm_open(key: str) -> int:
    """A descriptor of the POSIX shared-memory object ``key``, read and write, never created."""
    try:
        import _posixshmem  # CPython's own, what multiprocessing.shared_memory uses
    except ImportError:  # pragma: no cover - not a POSIX CPython
        return os.open("/dev/shm" + key, os.O_RDWR)
    return int(_posixshmem.shm_open(key, os.O_RDWR, mode=0o600))
