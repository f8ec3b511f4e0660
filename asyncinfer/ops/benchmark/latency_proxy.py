"""A TCP proxy that puts a Redis a zone away: every byte arrives a fixed delay after it was sent.

Each chunk read from one side is written to the other ``delay_ms`` after it arrived, whatever
else is on the way: the link has latency, not a narrower pipe — a client that keeps many commands
in flight gets them all through in one round trip, as over a real long link. ``--delay-ms 1``
each way makes a 2 ms round trip.

Runs as a process of its own (:class:`LatencyProxy` starts it), so its threads take nothing from
the GIL of the process it measures: ``python -m asyncinfer.ops.benchmark.latency_proxy --target-port P
--delay-ms D`` prints the port it listens on, then serves until stopped. Used by the bench
(``asyncinfer bench --redis-rtt-ms``) and by the tests of producers far from Redis.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

__all__ = ["LatencyProxy", "ping_ms", "main"]


class LatencyProxy:
    """``python -m asyncinfer.ops.benchmark.latency_proxy`` in front of the Redis at ``url``, adding
    ``rtt_ms / 2`` each way; :attr:`url` is the same Redis through it. Stopped by its PID.
    ``port``: where it listens (0: a free port; a proxy started again on the port of one stopped
    takes the place of a link that broke)."""

    def __init__(self, url: str, rtt_ms: float, *, port: int = 0) -> None:
        if not rtt_ms >= 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms!r}")
        self.target_url, self.rtt_ms = url, rtt_ms
        self.process: subprocess.Popen[str] | None = None
        self.port = port

    @property
    def url(self) -> str:
        """The target's URL with its host and port replaced by the proxy's."""
        parts = urlsplit(self.target_url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start(self) -> LatencyProxy:
        target = urlsplit(self.target_url)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "asyncinfer.ops.benchmark.latency_proxy",
             "--target-host", target.hostname or "127.0.0.1",
             "--target-port", str(target.port or 6379), "--delay-ms", str(self.rtt_ms / 2),
             "--port", str(self.port)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})  # this module's tree
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"latency proxy did not start (said {line!r})")
        self.port = int(line)
        return self

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def __enter__(self) -> LatencyProxy:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ping_ms(url: str, count: int = 200) -> float:
    """The median round trip of a PING to the Redis at ``url`` (ms)."""
    import statistics

    import redis

    client = redis.Redis.from_url(url)
    try:
        client.ping()
        times = []
        for _ in range(count):
            started = time.perf_counter()
            client.ping()
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)
    finally:
        client.close()


class _Direction:
    """One direction of one connection: a reader that stamps each chunk with its arrival, a
    writer that sends it once its delay has passed."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        self.source, self.sink, self.delay_s = source, sink, delay_s
        self.chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self.arrived = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.source.recv(262144):
                with self.arrived:
                    self.chunks.append((time.monotonic() + self.delay_s, data))
                    self.arrived.notify()
        except OSError:
            pass
        with self.arrived:  # the end of the stream travels with the same delay
            self.chunks.append((time.monotonic() + self.delay_s, b""))
            self.arrived.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.arrived:
                    while not self.chunks:
                        self.arrived.wait()
                    due = self.chunks[0][0]
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    time.sleep(wait_s)
                with self.arrived:  # this chunk, and every one due by now, in one write
                    now, data, ended = time.monotonic(), b"", False
                    while self.chunks and self.chunks[0][0] <= now and not ended:
                        chunk = self.chunks.popleft()[1]
                        data, ended = data + chunk, not chunk
                if data:
                    self.sink.sendall(data)
                if ended:
                    break
        except OSError:
            pass
        for s in (self.sink, self.source):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sink.close()


def serve(listener: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    while True:
        near, _ = listener.accept()
        try:
            far = socket.create_connection(target)
        except OSError:
            near.close()
            continue
        for s in (near, far):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Direction(near, far, delay_s)
        _Direction(far, near, delay_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-host", default="127.0.0.1")
    p.add_argument("--target-port", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True, help="added each way")
    p.add_argument("--port", type=int, default=0, help="where to listen (0: a free port)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.create_server(("127.0.0.1", args.port))
    print(listener.getsockname()[1], flush=True)
    serve(listener, (args.target_host, args.target_port), args.delay_ms / 1000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
