"""A gateway whose sockets are being starved still answers new callers, and says so in a few lines.

Issue 38's scene, as real processes at the default settings: a gateway under an open-files limit
of 1,024 (soft and hard: raising soft to hard gains nothing, so its connection caps are what
protect it), 1,000 connections that send nothing and 100 that send a request header a byte a
second. Before the gateway capped its connections and timed their headers, its descriptors ran
out, every new caller timed out, and it logged 622,362 tracebacks (276 MB) in 15 s.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncinfer.gateway.open_files import connection_caps
from tests.support.databases import RedisDatabase
from tests.support.processes import (
    GatewayProcess,
    WorkerProcess,
    gateway_ports_env,
    launch_worker,
    ready_together,
    stop_together,
    worker_env,
)

#: The open-files limit the gateway runs under (soft and hard), and what it is at the defaults.
OPEN_FILES = 1024
HEADER_TIMEOUT_S = 10.0  # ASYNCINFER_GATEWAY_HEADER_TIMEOUT_S's default
IDLE, SLOW = 1000, 100
CALLS = 40
#: The gateway's process, its open-files limit set (soft and hard) before it is the gateway.
_UNDER_LIMIT = ("import os, resource, sys; "
                f"resource.setrlimit(resource.RLIMIT_NOFILE, ({OPEN_FILES}, {OPEN_FILES})); "
                "os.execv(sys.executable, [sys.executable, '-m', 'asyncinfer', 'gateway', "
                "*sys.argv[1:]])")
SLOW_HEADER = (b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: gateway\r\n"
               b"Content-Type: application/json\r\nContent-Length: 60\r\n" + b"X-Pad: a" * 20)


@dataclass
class Fleet:
    worker: WorkerProcess
    gateway: GatewayProcess

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.gateway.http_port


@pytest.fixture()
def fleet(redis_db: RedisDatabase, tmp_path: Path) -> Iterator[Fleet]:
    ports = [int(p) for p in gateway_ports_env().values()]
    argv = [sys.executable, "-c", _UNDER_LIMIT, "--http-port", str(ports[0]),
            "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    worker = launch_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu",
                           "--models", "identity", "--concurrency", "8")
    gateway = GatewayProcess(argv, worker_env(redis_db.url), tmp_path / "gateway.log",
                             http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    ready_together([worker, gateway], 60.0)
    try:
        yield Fleet(worker, gateway)
    finally:
        stop_together([gateway, worker])


def _infer(address: tuple[str, int], value: float) -> float:
    """One call on a connection of its own (a new caller); its latency in seconds."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                   "data": [value, value + 1]}]})
    started = time.monotonic()
    c = http.client.HTTPConnection(*address, timeout=10)
    try:
        c.request("POST", "/v2/models/identity/infer", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        answer = r.read()
    finally:
        c.close()
    assert r.status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == [value, value + 1]
    return time.monotonic() - started


def _p95(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=20)[-1]


@dataclass
class SlowHeaders:
    """Connections that each send ``SLOW_HEADER`` a byte a second from a thread; each one's
    seconds from connecting to being closed by the gateway."""

    sockets: list[socket.socket]
    opened_at: float = field(default_factory=time.monotonic)
    closed_after_s: dict[int, float] = field(default_factory=dict)
    bytes_sent: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        for i in range(len(SLOW_HEADER)):
            for n, s in enumerate(self.sockets):
                if n in self.closed_after_s:
                    continue
                try:
                    if _closed(s):
                        raise ConnectionResetError
                    s.send(SLOW_HEADER[i:i + 1])
                except OSError:
                    self.closed_after_s[n] = time.monotonic() - self.opened_at
            self.bytes_sent = i + 1
            if len(self.closed_after_s) == len(self.sockets) or self.stop.wait(1.0):
                return


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(90)
def test_idle_and_slow_header_connections_do_not_starve_new_callers(fleet: Fleet) -> None:
    # Given a gateway under 1,024 open files, and how fast it answers new callers
    before = [_infer(fleet.address, float(i)) for i in range(CALLS)]
    logged = len(fleet.gateway.log().splitlines())

    # When 1,000 connections that send nothing and 100 that send a header a byte a second arrive
    idle = [socket.create_connection(fleet.address) for _ in range(IDLE)]
    slow = SlowHeaders([socket.create_connection(fleet.address) for _ in range(SLOW)])
    dripping = threading.Thread(target=slow.run, daemon=True)
    dripping.start()
    try:
        # then new callers are still answered, each on a connection of its own, about as fast
        during = []
        for i in range(CALLS):
            during.append(_infer(fleet.address, float(i)))
            time.sleep(0.1)
        # and every slow header is cut off once the header timeout has passed
        dripping.join(HEADER_TIMEOUT_S + 10)
        closed_idle = sum(_closed(s) for s in idle)
    finally:
        slow.stop.set()
        dripping.join(5)
        for s in idle + slow.sockets:
            s.close()
    log_lines = fleet.gateway.log().splitlines()[logged:]
    print(f"p95 before {_p95(before) * 1000:.1f} ms, during {_p95(during) * 1000:.1f} ms; "
          f"slow headers closed after {min(slow.closed_after_s.values()):.1f}-"
          f"{max(slow.closed_after_s.values()):.1f} s ({slow.bytes_sent} bytes sent); "
          f"idle closed {closed_idle}/{IDLE}; {len(log_lines)} log lines:\n" + "\n".join(log_lines))
    assert len(during) == CALLS
    assert _p95(during) < 2 * _p95(before) + 1.0
    assert len(slow.closed_after_s) == SLOW
    assert max(slow.closed_after_s.values()) < HEADER_TIMEOUT_S + 3
    assert slow.bytes_sent < len(SLOW_HEADER)  # none of them got its header in
    assert closed_idle == IDLE

    # and the gateway said so in a few lines, with no traceback and no failed accept
    log = "\n".join(log_lines)
    assert len(log_lines) < 50
    assert "Traceback" not in log and "Too many open files" not in log
    caps = connection_caps(OPEN_FILES)
    assert (f"HTTP connections at the cap ({caps.http}): closed the longest idle to take a new one"
            in log)
    header_lines = [line for line in log_lines if "sent no complete request header" in line]
    assert 1 <= len(header_lines) <= 3
    assert f"open-files limit: soft {OPEN_FILES} -> {OPEN_FILES} (hard {OPEN_FILES})" in \
        fleet.gateway.log()

    # and once it stops, the counts it held back add up: each of the 1,100 was closed once, for
    # the cap or for its header
    stop_together([fleet.gateway])
    log_lines = fleet.gateway.log().splitlines()[logged:]
    counts = [line for line in log_lines if "more like this" in line]
    print("\n".join(counts))
    closed = sum(1 + sum(int(c.split(": ", 1)[1].split()[0]) for c in counts if what in c)
                 for what in ("at the cap", "no complete request header"))
    assert closed == IDLE + SLOW
