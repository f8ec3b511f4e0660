"""The bench runs end to end (a short smoke run; its figures are not asserted on)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(240)


def test_bench_smoke_run_writes_json_markdown_and_plot(redis_url, tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncinfer", "bench", "--workloads", "identity,pipeline3-async",
         "--systems", "celery,asyncinfer", "--in-flight", "1,4", "--rates", "0.5",
         "--duration-s", "0.5", "--concurrency", "8", "--broker-url", redis_url,
         "--out", str(tmp_path)],
        env=worker_env(redis_url), cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    runs = {(r["workload"], r["system"], r["mode"], r["level"]) for r in doc["runs"]}
    # every system × level was run, and plain Celery is not run on the synthetic pipeline
    assert {("identity", s, "closed", lv) for s in ("celery", "asyncinfer") for lv in (1, 4)} <= runs
    assert {r[1] for r in runs if r[0] == "pipeline3-async"} == {"asyncinfer"}
    assert all(r["failures"] == 0 and r["requests"] > 0 for r in doc["runs"])
    assert float(doc["limits"]["identity"]["1"]) > 0 and doc["direct_call_ms"]["identity"] > 0
    assert {t["name"].split(",")[0] for t in doc["targets"]} >= {"identity"}
    assert (tmp_path / "bench.md").read_text().startswith("| workload | system |")
    assert (tmp_path / "bench.png").stat().st_size > 1000
