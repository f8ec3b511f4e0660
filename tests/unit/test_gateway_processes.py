"""``gateway --processes``' own checks, in process: a port another process listens on (with
SO_REUSEPORT or without) is refused before any child starts; each child's ports."""

from __future__ import annotations

import socket

import pytest

from asyncinfer.config.settings import Settings
from asyncinfer.gateway.processes import check_free, child_ports
from asyncinfer.gateway.server import Ports
from asyncinfer.ops.cli import build_parser

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_another_process_listens_on_is_refused_naming_it(reuse_port: bool) -> None:
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind gRPC to 127.0.0.1:{port}: .*in use"):
            check_free("127.0.0.1", port, "gRPC")
    check_free("127.0.0.1", port, "gRPC")  # closed: free again


def test_children_share_the_fronts_ports_and_each_has_its_own_metrics_port() -> None:
    ports = Ports("0.0.0.0", 8000, 8001, 8002)
    assert [child_ports(ports, i) for i in range(3)] == [
        Ports("0.0.0.0", 8000, 8001, 8002), Ports("0.0.0.0", 8000, 8001, 8003),
        Ports("0.0.0.0", 8000, 8001, 8004)]
    assert child_ports(Ports("h", 1, 2, 0), 1) == Ports("h", 1, 2, 0)  # metrics off stays off


@pytest.mark.parametrize("value, message", [("0", "must be at least 1, got 0"),
                                            ("two", "must be a whole number of at least 1")])
def test_processes_must_be_a_positive_number(value: str, message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--processes", value])
    assert f"--processes: {message}" in capsys.readouterr().err


def test_gateway_processes_below_zero_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCINFER_GATEWAY_PROCESSES", "-1")
    with pytest.raises(ValueError, match="gateway_processes must be >= 0"):
        Settings.from_env()
