"""The bench's peers (Triton, Ray Serve) in the parts that need neither their venv nor a process:
reading their load generator's result line, skipping them where they are not installed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.bench.peers import PEERS_VENV_ENV, missing_message
from asyncinfer.bench.peers.host import tree_cpu_s, tree_pids
from asyncinfer.bench.peers.runner import run_from_line
from asyncinfer.bench.peers.served import request_rows
from asyncinfer.bench.systems import available_systems

pytestmark = pytest.mark.unit


def _line(**changes: object) -> str:
    doc = {"peer": "triton", "workload": "minilm", "level": 256,
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


def test_without_the_peers_venv_the_peers_are_skipped_in_one_line_naming_make_peers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path / "no-such-venv"))
    kept = available_systems(["celery", "triton", "asyncinfer", "ray"])
    assert kept == ["celery", "asyncinfer"]
    assert capsys.readouterr().out.splitlines() == [missing_message("triton"), missing_message("ray")]
    assert "make peers" in missing_message("triton")


def test_with_the_peers_venv_the_peers_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path))
    assert available_systems(["triton", "ray"]) == ["triton", "ray"]


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
