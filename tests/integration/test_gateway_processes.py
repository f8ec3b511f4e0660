"""``asyncinfer gateway --processes 2``, real processes in front of the session worker: both
children answer calls on the one gRPC port, a child killed is started again while the other
serves, a taken port still fails loudly, and a stop leaves no child behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from asyncinfer.ops.redis_server import free_port
from asyncinfer.supervision.processes import pid_alive, stop_process
from tests.support.processes import ROOT, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

_READY = re.compile(r"asyncinfer gateway ready: .*metrics on http://127\.0\.0\.1:(\d+)/metrics "
                    r"\(pid (\d+)\)")


def _free_pair() -> int:
    """A free port whose next port is free too (the second child's metrics port)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


class Gateways:
    """``asyncinfer gateway --processes 2`` (the supervisor) and its output."""

    def __init__(self, redis_url: str, log_path: Path) -> None:
        self.http, self.grpc, self.metrics = free_port(), free_port(), _free_pair()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        argv = [sys.executable, "-m", "asyncinfer", "gateway", "--http-port", str(self.http),
                "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                "--processes", "2"]
        self.process = subprocess.Popen(argv, env=worker_env(redis_url), cwd=ROOT, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def children(self) -> dict[int, int]:
        """Metrics port → PID of the child that last said it is ready on it."""
        return {int(port): int(pid) for port, pid in _READY.findall(self.log())}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> dict[int, int]:
        wait_for(lambda: len(self.children()) == 2 or self.process.poll() is not None, 90.0,
                 "both gateway processes ready")
        assert self.process.poll() is None, self.log()[-3000:]
        return self.children()

    def stop(self) -> int:
        code = stop_process(self.process, signal.SIGTERM, 60)
        self._log.close()
        return code


@pytest.fixture(scope="module")
def gateways(redis_url: str, worker: object, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Gateways]:
    gw = Gateways(redis_url, tmp_path_factory.mktemp("gateways") / "gateways.log")
    try:
        gw.wait_ready()
        yield gw
    finally:
        gw.stop()


def _infer(port: int, value: float) -> np.ndarray:
    """One identity call through a gRPC client of its own (a connection of its own)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}",
                                              channel_args=[("grpc.use_local_subchannel_pool", 1)])
    try:
        x = np.full((1, 8), value, np.float32)
        tensor = grpcclient.InferInput("input", [1, 8], "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("identity", [tensor]).as_numpy("input")  # identity: outputs = inputs
    finally:
        client.close()


def _answered(metrics_port: int) -> float:
    """The identity calls a child answered over gRPC, from its own metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = (r'asyncinfer_gateway_requests_total\{code="200",model="identity",protocol="grpc"\} '
               r"(\S+)")
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def test_both_processes_answer_calls_on_the_one_grpc_port(gateways: Gateways) -> None:
    before = {port: _answered(port) for port in gateways.children()}
    for i in range(24):
        assert _infer(gateways.grpc, float(i)).tolist() == [[float(i)] * 8]
    served = {port: _answered(port) - before[port] for port in gateways.children()}
    assert sum(served.values()) == 24
    assert all(n > 0 for n in served.values()), served  # 24 connections, two children: both


def test_a_killed_process_is_restarted_while_the_other_serves(gateways: Gateways) -> None:
    children = gateways.wait_ready()
    victim_port, victim = sorted(children.items())[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim), 10.0, "the killed child gone")
    for i in range(4):  # the other child answers meanwhile
        assert _infer(gateways.grpc, 100.0 + i).tolist() == [[100.0 + i] * 8]
    wait_for(lambda: gateways.children().get(victim_port, victim) != victim, 60.0,
             "the killed child started again")
    restarted = gateways.children()[victim_port]
    assert pid_alive(restarted) and restarted != victim
    assert _answered(victim_port) == 0.0  # a new process serves that metrics port: no calls yet
    assert "exited with -9; restarting" in gateways.log()


def test_a_taken_port_fails_loudly_with_or_without_processes(gateways: Gateways) -> None:
    for extra, port_args, message in (
            ([], ["--http-port", str(gateways.http), "--grpc-port", "0"],
             f"('127.0.0.1', {gateways.http}): address already in use"),
            (["--processes", "2"], ["--http-port", "0", "--grpc-port", str(gateways.grpc)],
             f"cannot bind gRPC to 127.0.0.1:{gateways.grpc}: Address already in use")):
        done = subprocess.run([sys.executable, "-m", "asyncinfer", "gateway", *port_args,
                               "--metrics-port", "0", *extra], env=worker_env("redis://127.0.0.1:1/0"),
                              cwd=ROOT, capture_output=True, timeout=60)
        assert done.returncode == 78, done.stderr.decode()[-2000:]
        assert message in done.stderr.decode()


def test_a_stop_stops_every_process_and_leaves_none_behind(redis_url: str, worker: object,
                                                           tmp_path: Path) -> None:
    gw = Gateways(redis_url, tmp_path / "gateways.log")
    try:
        pids = list(gw.wait_ready().values())
        assert all(pid_alive(pid) for pid in pids)
        assert _infer(gw.grpc, 7.0).tolist() == [[7.0] * 8]
    finally:
        code = gw.stop()
    assert code == 0
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert gw.log().count("gateway stopped") == 2 and "asyncinfer gateway: stopped" in gw.log()
