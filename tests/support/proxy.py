"""A TCP proxy that can stop forwarding and heal: a worker cut off from Redis by a partition.

While cut, it accepts connections and reads nothing, so what either side sends waits in socket
buffers as it would on a dead link (no reset, no error: the client only times out); healed, it
forwards what waited. Runs on threads of the test's process; :meth:`close` stops them all.
"""

from __future__ import annotations

import select
import socket
import threading

__all__ = ["Partition"]


class Partition:
    """Listens on 127.0.0.1 (``port``) and forwards to ``target_port`` until :meth:`cut`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="partition-accept").start()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self) -> None:
        """Stop forwarding, both ways, on every connection (new ones too)."""
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        self._server.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                near, _ = self._server.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                near.close()
                continue
            with self._lock:
                self._sockets += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True,
                                 name="partition-pump").start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                self._open.wait()
                ready, _, _ = select.select([source], [], [], 0.1)
                if not ready or not self._open.is_set():
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
