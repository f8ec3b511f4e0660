"""The device marks: which requests are on this worker's device now, on Redis, so that a worker's
death counts against them (``asyncinfer:deaths:<id>``, counted by the lease sweep, leases.py).

The marks are written from the device thread just before each batch launches, and the device
thread does not wait for Redis: it hands the commands to the kernel on a connection of their own
on which Redis never answers (``CLIENT REPLY OFF``), and launches. Waiting for the reply cost
4–5 ms a batch on a busy 2-core host (the round trip, then the GIL back from the threads that
write the last batch's results). The send itself is a non-blocking ``send(2)`` made through
``ctypes.PyDLL``, which keeps the GIL: Python's own socket calls release it, and a device thread
that released it may wait for it again up to the switch interval (5 ms) behind busy threads
(``bench/device_marks_cost.py``). TLS connections, and a send the kernel does not take whole at
once, go through Python's ``sendall``.

What is guaranteed, exactly:

- **Before a batch launches, its marks have left the process**: the device thread's ``send`` has
  returned, so the bytes are the kernel's. On loopback and Unix sockets they are then already in
  Redis' receive buffer. A kill -9 (or a crash, an abort) a microsecond after the launch does not
  take them back: nothing is ever received on this connection (Redis sends no reply), so closing
  it sends FIN after the data, not a reset (Linux resets, and drops what it has not sent yet, only
  a socket closed with received data unread); Redis reads what came before the FIN and runs it.
- **A death counts against the batches on the device, not the next one**: a batch is marked only
  at its own launch, by the thread that launches it, never ahead of it.
- **Order**: the marks of batches that came off the device are removed in the same send as the next
  batch's marks, before them, and Redis runs one connection's commands in order: a death counts
  against a finished batch only until the next batch launches (a worker that dies between two
  batches — in a postprocess, or idle after the last — counts one death against the last batch
  it ran, if its requests are not acknowledged yet; an acknowledged request is no longer held,
  and the sweep counts nothing against it).
- A batch that runs alone (a request in it saw a death) waits for Redis to have run its marks,
  as every batch did before: the round trip leaves the result writer time to store the results
  of the batch that ran just before it, which a second death would otherwise run again. Not a
  guarantee (those results may still be on their way), and only after deaths.
- Several device threads (instances) send under one lock: each batch's marks are sent before it
  launches, whichever thread launches it.

What is not: marks are lost — the batch runs, and a death during it counts against nobody, as
when Redis could not be reached before — when the host itself dies or the network is cut before
the bytes reach Redis (the lease still expires and the requests go back), when Redis refuses the
write (out of memory: no reply, so no error is seen), and when Redis closed the connection between
the check before a send and the send itself (a restart, ``timeout``). Every send first checks that
Redis has not closed the connection (it would be readable: no reply ever comes otherwise); a
closed one, or one a send fails on, is opened again, and every mark still on the device is sent
again with the new ones.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import redis

from asyncinfer.wire.keys import LEASE_DEVICE_KEY

__all__ = ["DeviceMarks", "OnDevice"]


class OnDevice(Protocol):
    """What a mark follows of a request's work item (the engine's ``WorkItem``): whether its batch
    is on the device still."""

    on_device: bool

log = logging.getLogger(__name__)

#: How long (seconds) a device thread leaves the connection alone after it could not open it.
RECONNECT_AFTER_S = 1.0

_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)


def _libc() -> Any:
    """The C library through ``ctypes.PyDLL``: its calls keep the GIL (None where unavailable)."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        for name in ("send", "recv"):
            fn = getattr(libc, name)
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
        return libc
    except (OSError, AttributeError):
        return None


#: Python's socket calls release the GIL, and a device thread that released it waits for it
#: again behind the busy threads, up to the switch interval (5 ms): a few microseconds of
#: non-blocking send are made holding it.
_LIBC = _libc() if _FLAGS else None
_PEEK = ctypes.create_string_buffer(1)


def _send_all(sock: Any, data: bytes) -> None:
    """Send ``data`` on ``sock``: without releasing the GIL when the kernel takes it at once (a
    plain socket), else as Python sends (blocking, the GIL released)."""
    if _LIBC is not None and not isinstance(sock, ssl.SSLSocket):
        sent = _LIBC.send(sock.fileno(), data, len(data), _FLAGS)
        if sent == len(data):
            return
        if sent < 0:
            err = ctypes.get_errno()
            if err not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                raise OSError(err, f"device marks: send failed: {errno.errorcode.get(err, err)}")
            sent = 0
        data = data[sent:]
    sock.sendall(data)


def _closed(sock: Any) -> bool:
    """Whether ``sock`` is readable — closed by the peer, or holding something to read — without
    releasing the GIL where it can."""
    if _LIBC is not None and not isinstance(sock, ssl.SSLSocket):
        got = _LIBC.recv(sock.fileno(), _PEEK, 1, _FLAGS | socket.MSG_PEEK)
        return not (got < 0 and ctypes.get_errno() in (errno.EAGAIN, errno.EWOULDBLOCK))
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class DeviceMarks:
    """The marks of what is on the device, sent on a connection of their own (a new connection
    of ``client``'s pool, with its address, credentials and TLS) on which Redis never replies."""

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        kwargs = {**pool.connection_kwargs, "health_check_interval": 0}
        self._connection: Any = pool.connection_class(**kwargs)
        #: Whether the connection is open with replies off (sends go straight to its socket).
        self._open = False
        self._retry_at = 0.0
        #: What is marked now, by tag: the request ID and the work item (its ``on_device`` flag
        #: says when it came off).
        self._marked: dict[str, tuple[str, OnDevice]] = {}
        self._lock = threading.Lock()
        #: Sends, and the connections opened, for the tests and the note.
        self.sends = 0
        self.connects = 0

    def on_device(self, marks: Sequence[tuple[str, str, OnDevice]], wait: bool = False) -> None:
        """``marks`` — (delivery tag, request ID, work item) — are going onto the device. Returns
        once the commands are the kernel's (module docstring), or with ``wait`` once Redis has run
        them; a failure is logged, and the batch runs all the same."""
        self._mark(marks)
        if wait:
            try:
                self.sync()
            except (OSError, redis.RedisError) as exc:
                self.close()
                log.warning("could not confirm the device marks (%s)", exc)

    def _mark(self, marks: Sequence[tuple[str, str, OnDevice]]) -> None:
        with self._lock:
            off = [tag for tag, (_, item) in self._marked.items() if not item.on_device]
            for tag in off:
                del self._marked[tag]
            for tag, rid, item in marks:
                self._marked[tag] = (rid, item)
            if not (marks or off):
                return
            for attempt in (1, 2):  # a send that fails opens the connection again, once
                try:
                    if self._open and hasattr(self._connection, "leave_old_master"):
                        self._connection.leave_old_master()  # Sentinel: at most once a second
                    if not self._open or self._connection._sock is None or self._closed_by_redis():
                        if not self._reopen():
                            return
                        marks = [(tag, rid, item) for tag, (rid, item) in self._marked.items()]
                    self._send(off, marks)
                    return
                except (OSError, redis.RedisError) as exc:
                    self._close()
                    if attempt == 2:
                        log.warning("could not mark %d requests as on the device (%s)",
                                    len(marks), exc)

    def sync(self, timeout_s: float = 5.0) -> None:
        """Wait until Redis has run every mark sent so far: a round trip, replies on for it (a
        batch that runs alone, and the tests)."""
        with self._lock:
            if not self._open or self._connection._sock is None:
                return
            c = self._connection
            _send_all(c._sock, b"".join(c.pack_commands([("CLIENT", "REPLY", "ON"), ("PING",)])))
            c.read_response(timeout=timeout_s)
            c.read_response(timeout=timeout_s)
            _send_all(c._sock, b"".join(c.pack_commands([("CLIENT", "REPLY", "OFF")])))

    def close(self) -> None:
        with self._lock:
            self._close()

    # -- the connection ---------------------------------------------------------------------

    def _send(self, off: list[str], marks: Sequence[tuple[str, str, OnDevice]]) -> None:
        commands: list[tuple[Any, ...]] = []
        if off:
            commands.append(("HDEL", LEASE_DEVICE_KEY, *off))
        if marks:
            commands.append(("HSET", LEASE_DEVICE_KEY,
                             *[v for tag, rid, _ in marks for v in (tag, rid)]))
        if not commands:
            return
        _send_all(self._connection._sock, b"".join(self._connection.pack_commands(commands)))
        self.sends += 1

    def _closed_by_redis(self) -> bool:
        """Whether the connection is readable: Redis sends nothing on it but its close (or an
        error before replies went off); either way it is opened again."""
        return _closed(self._connection._sock)

    def _reopen(self) -> bool:
        """Open the connection (redis-py's handshake: auth, database, TLS), then turn replies
        off. False when it cannot be opened now (tried again after :data:`RECONNECT_AFTER_S`)."""
        self._close()
        now = time.monotonic()
        if now < self._retry_at:
            return False
        try:
            self._connection.connect()
            self._connection.send_packed_command(
                self._connection.pack_command("CLIENT", "REPLY", "OFF"), check_health=False)
        except (OSError, redis.RedisError) as exc:
            self._close()
            self._retry_at = now + RECONNECT_AFTER_S
            log.warning("could not open the device marks' connection (%s); the batches run "
                        "unmarked, a death during them counts against nobody", exc)
            return False
        self._open = True
        self.connects += 1
        return True

    def _close(self) -> None:
        self._open = False
        try:
            self._connection.disconnect()
        except Exception:  # noqa: BLE001 - closing what may already be broken
            pass
