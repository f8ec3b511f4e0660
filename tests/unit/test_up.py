"""``asyncinfer up``'s own choices, in process: its gateway's processes, a routing table refused."""

from __future__ import annotations

import pytest

from asyncinfer.config.settings import Settings
from asyncinfer.ops.cli import _gateway_flags, build_parser
from asyncinfer.ops.up import gateway_child, gateway_line, run_up
from asyncinfer.supervision.supervisor import CANNOT_START

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


def test_up_passes_its_model_control_mode_to_its_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given no flag and no setting, up's gateway refuses model control (Triton's default, none)
    monkeypatch.delenv("ASYNCINFER_MODEL_CONTROL_MODE", raising=False)

    def mode(argv: list[str]) -> str:
        child = gateway_child(Settings.from_env(**_gateway_flags(build_parser().parse_args(argv))),
                              {})
        return child.argv[child.argv.index("--model-control-mode") + 1]

    assert mode(["up"]) == "none"
    # When `up --model-control-mode explicit`, or the setting, Then its gateway serves it
    assert mode(["up", "--model-control-mode", "explicit"]) == "explicit"
    monkeypatch.setenv("ASYNCINFER_MODEL_CONTROL_MODE", "explicit")
    assert mode(["up"]) == "explicit"
    assert mode(["up", "--model-control-mode", "none"]) == "none"  # the flag wins
