"""The bench's peers (Triton, Ray Serve) and its gateway systems in the parts that need neither the
peers' venv nor a process: reading the load generator's result line, finding the peers' folder and
venv, skipping the peers where they are not there."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

import asyncinfer
from asyncinfer.ops.benchmark.host import tree_cpu_s, tree_pids
from asyncinfer.ops.benchmark.peer_servers import PEERS, PEERS_DIR_ENV, PEERS_VENV_ENV, Peers, missing_message
from asyncinfer.ops.benchmark.systems import GATEWAYS, available_systems
from asyncinfer.ops.benchmark.v2_loadgen import (
    TARGETS,
    grpc_parameter,
    parse_cpu_pids,
    request_rows,
    run_from_line,
)

ROOT = Path(__file__).resolve().parents[2]
#: The checkout's peers folder: scripts, not a package, and not installed.
PEERS_DIR = ROOT / "bench" / "peers"


def _line(**changes: object) -> str:
    doc = {"target": "triton", "workload": "minilm", "level": 256,
           "latencies_ms": [10.0, 20.0, 30.0, 40.0], "failures": 1, "elapsed_s": 2.0,
           "batch_sizes": {"32": 3, "8": 1}, "client_cpu_s": 0.002, "server_cpu_s": 0.02}
    doc.update(changes)
    return json.dumps(doc)


def test_a_load_generator_line_becomes_the_benchs_run() -> None:
    run = run_from_line("triton", "minilm", _line())
    summary = run.summary()
    assert (summary["system"], summary["workload"], summary["mode"], summary["level"]) == (
        "triton", "minilm", "closed", 256)
    assert summary["throughput_rps"] == 2.0  # 4 completed in 2 s
    assert (summary["requests"], summary["failures"]) == (5, 1)
    assert summary["batch_sizes"] == {"8": 1, "32": 3}
    # the server's CPU takes the worker column, the generator's the client one; no Redis
    assert summary["worker_cpu_ms_per_request"] == 5.0
    assert summary["client_cpu_ms_per_request"] == 0.5
    assert summary["redis_cpu_ms_per_request"] is None


def test_a_line_that_is_no_result_is_refused_with_what_it_was() -> None:
    with pytest.raises(ValueError, match="not a load generator result line: 'Traceback"):
        run_from_line("ray", "minilm", "Traceback (most recent call last):")
    with pytest.raises(ValueError, match="latencies_ms"):
        run_from_line("ray", "minilm", json.dumps({"level": 1}))


def _venv(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    return path


def test_without_the_peers_venv_the_peers_are_skipped_in_one_line_naming_make_peers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peers = Peers.find(PEERS_DIR, tmp_path / "no-such-venv")
    kept = available_systems(["celery", "triton", "asyncinfer", "ray"], peers)
    assert kept == ["celery", "asyncinfer"]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [missing_message("triton", peers.missing("triton") or ""),
                     missing_message("ray", peers.missing("ray") or "")]
    assert lines[0].startswith("bench: skipping triton: the peers venv")
    assert "make peers" in lines[0] and str(tmp_path / "no-such-venv") in lines[0]


def test_without_the_peers_folder_the_peers_are_skipped_in_one_line_naming_the_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peers = Peers.find(tmp_path / "no-such-folder", _venv(tmp_path / "venv"))
    assert available_systems(["triton", "asyncinfer"], peers) == ["asyncinfer"]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"bench: skipping triton: no peers folder at {tmp_path / 'no-such-folder'}")
    assert "--peers-dir" in line and PEERS_DIR_ENV in line


def test_with_the_peers_folder_and_venv_the_peers_stay(tmp_path: Path) -> None:
    peers = Peers.find(PEERS_DIR, _venv(tmp_path / "venv"))
    assert available_systems(["triton", "ray"], peers) == ["triton", "ray"]


def test_the_peers_are_looked_for_in_the_current_directory_unless_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEERS_DIR_ENV, raising=False)
    monkeypatch.delenv(PEERS_VENV_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert Peers.find() == Peers(tmp_path / "bench" / "peers", tmp_path / ".venv-peers")
    monkeypatch.setenv(PEERS_DIR_ENV, "/elsewhere/peers")
    monkeypatch.setenv(PEERS_VENV_ENV, "/elsewhere/venv")
    assert Peers.find() == Peers(Path("/elsewhere/peers"), Path("/elsewhere/venv"))
    assert Peers.find("p", "v") == Peers(tmp_path / "p", tmp_path / "v")  # the options win


def test_the_peers_import_this_asyncinfer_alone_and_their_own_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCINFER_BROKER_URL", "redis://elsewhere:1/0")
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    env = Peers.find(PEERS_DIR, tmp_path / "venv").env(tmp_path)
    first, folder, rest = env["PYTHONPATH"].split(os.pathsep)
    assert sorted(p.name for p in Path(first).iterdir()) == ["asyncinfer"]
    assert (Path(first) / "asyncinfer").resolve() == Path(asyncinfer.__file__).resolve().parent
    assert (folder, rest) == (str(PEERS_DIR), "/already/there")
    assert not [k for k in env if k.startswith("ASYNCINFER_")]


def test_the_peers_get_the_benchs_own_requests() -> None:
    name, datatype, rows = request_rows("minilm", 2)
    assert (name, datatype) == ("text", "BYTES")
    assert [r.tolist() for r in rows] == [[b"A man is playing a guitar on the stage."],
                                         [b"The quick brown fox jumps over the lazy dog."]]
    name, datatype, rows = request_rows("sim-fast", 1)
    assert (name, datatype, rows[0].shape, rows[0].dtype) == ("input", "FP32", (1, 4), np.float32)


def test_a_process_tree_starts_at_its_root_and_counts_its_cpu() -> None:
    assert tree_pids(os.getpid())[0] == os.getpid()
    assert tree_cpu_s(os.getpid()) > 0


def test_a_gateway_line_puts_the_gateway_worker_and_redis_cpu_in_their_own_columns() -> None:
    line = _line(target="gateway", cpu_s={"worker": 0.008, "redis": 0.004, "other": 1.0})
    summary = run_from_line("gateway", "minilm", line, server="gateway").summary()
    assert summary["gateway_cpu_ms_per_request"] == 5.0  # 0.02 s over 4 requests
    assert summary["worker_cpu_ms_per_request"] == 2.0
    assert summary["redis_cpu_ms_per_request"] == 1.0
    assert summary["client_cpu_ms_per_request"] == 0.5
    # a peer's line has no gateway: its column stays empty
    assert run_from_line("triton", "minilm", _line()).summary()["gateway_cpu_ms_per_request"] is None
    with pytest.raises(ValueError, match="unknown CPU column 'disk'"):
        run_from_line("gateway", "minilm", line, server="disk")


def test_the_load_generator_reads_cpu_pids_as_name_equals_pid() -> None:
    assert parse_cpu_pids(["worker=12", "redis=7"]) == {"worker": 12, "redis": 7}
    assert parse_cpu_pids([]) == {}
    for bad in ("worker", "=12", "worker=x", "worker=-1"):
        with pytest.raises(ValueError, match="NAME=PID"):
            parse_cpu_pids([bad])


def test_the_gateways_batch_size_is_read_from_a_grpc_response_parameter() -> None:
    from asyncinfer.gateway.proto import inference_pb2 as pb

    response = pb.ModelInferResponse()
    response.parameters["batch_size"].int64_param = 17
    response.parameters["worker"].string_param = "w1@host"
    assert grpc_parameter(response.parameters["batch_size"]) == 17
    assert grpc_parameter(response.parameters["worker"]) == "w1@host"
    assert grpc_parameter(pb.InferParameter()) is None


def test_the_load_generator_drives_the_gateways_two_fronts_and_the_peers_add_theirs() -> None:
    assert set(TARGETS) == set(GATEWAYS)
    assert GATEWAYS == {"gateway": "gRPC", "gateway-http": "HTTP"}
    spec = importlib.util.spec_from_file_location("peers_loadgen", PEERS_DIR / "loadgen.py")
    assert spec is not None and spec.loader is not None
    loadgen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loadgen)  # not run: its main runs under ``__main__`` only
    assert set(loadgen.PEER_CONNECTORS) == {*PEERS, *GATEWAYS}
    assert all((PEERS_DIR / f"{peer}_server.py").is_file() for peer in PEERS)
