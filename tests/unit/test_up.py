"""``asyncinfer up``'s own choices, in process: its gateway's processes, a routing table refused."""

from __future__ import annotations

import pytest

from asyncinfer.config.settings import Settings
from asyncinfer.ops.cli import _gateway_flags, build_parser
from asyncinfer.ops.up import gateway_child, gateway_line, run_up
from asyncinfer.worker.supervisor import CANNOT_START

pytestmark = pytest.mark.timeout(10)


def test_up_starts_its_gateway_with_the_processes_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # `up --gateway-processes 3` (or ASYNCINFER_GATEWAY_PROCESSES) reaches the gateway's argv
    args = build_parser().parse_args(["up", "--gateway-processes", "3"])
    settings = Settings.from_env(**_gateway_flags(args))
    child = gateway_child(settings, {})
    assert child.argv[child.argv.index("--processes") + 1] == "3"
    assert gateway_line(settings).startswith("gateway (3 processes): v2 HTTP")
    monkeypatch.setenv("ASYNCINFER_GATEWAY_PROCESSES", "2")
    from_env = Settings.from_env(**_gateway_flags(build_parser().parse_args(["up"])))
    assert gateway_child(from_env, {}).argv[-2:] == ["--processes", "2"]
    monkeypatch.delenv("ASYNCINFER_GATEWAY_PROCESSES")
    assert "--processes" not in gateway_child(Settings.from_env(), {}).argv  # one process


def test_up_refuses_a_routing_table(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    # `up` runs every model on one Redis: a table would send its workers' models elsewhere
    monkeypatch.setenv("ASYNCINFER_BROKER_ROUTES", "mlp=redis://127.0.0.1:1/0")
    assert run_up() == CANNOT_START
    assert "ASYNCINFER_BROKER_ROUTES is set" in capsys.readouterr().err
