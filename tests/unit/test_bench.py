"""The bench's accelerator-shaped ``sim`` models, its in-process limit, its systems and its report
rows, in process."""

from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.models.registry import Registry
from asyncinfer.ops.benchmark.measure import Run, _rate, model_limit
from asyncinfer.ops.benchmark.report import markdown
from asyncinfer.ops.benchmark.run import SYSTEMS, added_latency_targets, parse_systems
from asyncinfer.ops.benchmark.synthetic import SimDevice, sim_fast, sim_prep, sim_slow
from asyncinfer.ops.benchmark.workloads import WORKLOADS


def test_the_sim_devices_limits_are_their_batch_over_their_time() -> None:
    assert round(sim_slow().limit_rows_per_s()) == 615  # 32 / (20 ms + 32 × 1 ms)
    assert round(sim_fast().limit_rows_per_s()) == 4444  # 32 / (4 ms + 32 × 0.1 ms)
    assert round(sim_prep().limit_rows_per_s()) == 2353  # ... + 32 × 0.2 ms of held GIL


def test_a_sim_forward_doubles_its_rows() -> None:
    model = SimDevice("sim-test", 0.0, 0.0)
    out = model.forward({"input": np.ones((3, 4), np.float32)})
    assert out["output"].tolist() == [[2.0] * 4] * 3


def test_the_in_process_limit_never_uses_a_batch_the_model_would_not_run() -> None:
    model = SimDevice("sim-test", 0.0005, 0.0)
    rates = model_limit(model, WORKLOADS["sim-fast"].payload(0), (1, 8, 64), 0.02)
    assert sorted(rates) == [1, 8, 32]  # 64 is over max_batch_size 32; 32 itself is measured
    assert rates[32] > rates[1] > 0


class _Counting:
    """Three stages that record which batch each call was given."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def preprocess(self, batch: dict[str, int]) -> dict[str, int]:
        self.seen.append(batch["k"])
        return batch

    def forward(self, batch: dict[str, int]) -> dict[str, int]:
        return batch

    def postprocess(self, batch: dict[str, int]) -> dict[str, int]:
        return batch


@pytest.mark.parametrize("callers", [1, 3])
def test_the_in_process_limit_is_measured_over_whole_passes(callers: int) -> None:
    # batches of unlike cost: a run cut off mid-pass would be the rate of those it reached
    model = _Counting()
    batches = [{"k": k} for k in range(7)]
    rate = _rate(model, batches, rows=4, callers=callers, duration_s=0.0)  # type: ignore[arg-type]
    assert sorted(model.seen) == list(range(7))  # one whole pass, each batch once
    model.seen.clear()
    _rate(model, batches, rows=4, callers=callers, duration_s=0.05)  # type: ignore[arg-type]
    assert len(model.seen) % 7 == 0 and len(model.seen) >= 7
    assert sorted(model.seen) == sorted(list(range(7)) * (len(model.seen) // 7))
    assert rate > 0


@pytest.mark.parametrize("name", ["sim-slow", "sim-fast", "sim-prep"])
def test_each_sim_workload_names_a_model_its_factory_makes(name: str) -> None:
    workload = WORKLOADS[name]
    model = Registry.from_config([workload.factories]).create(workload.model)
    assert model.name == name and model.options.max_batch_size == 32


def _run(system: str, workload: str, level: int, p50_ms: float, **cpu: float) -> dict[str, object]:
    run = Run(system, workload, "closed", level, latencies_ms=[p50_ms] * 3, elapsed_s=1.0)
    run.batch_sizes[1] = 3
    for column, value in cpu.items():
        setattr(run, f"{column}_cpu_ms_per_request", value)
    return run.summary()


def test_systems_are_checked_before_anything_starts() -> None:
    assert parse_systems("asyncinfer, gateway,triton,gateway") == ["asyncinfer", "gateway", "triton"]
    assert set(SYSTEMS) == {"celery", "asyncinfer", "gateway", "gateway-http", "triton", "ray"}
    with pytest.raises(SystemExit, match=r"unknown system\(s\) \['gatway'\]"):
        parse_systems("asyncinfer,gatway")


def test_the_gateways_added_latency_is_its_p50_less_the_clients_at_one_in_flight() -> None:
    doc = {"runs": [_run("asyncinfer", "mlp", 1, 2.0), _run("asyncinfer", "mlp", 256, 25.0),
                    _run("gateway", "mlp", 1, 2.75), _run("gateway", "mlp", 256, 400.0),
                    _run("gateway-http", "mlp", 1, 4.5),
                    _run("gateway", "minilm", 1, 30.0)]}  # no asyncinfer run: no figure
    targets = added_latency_targets(doc)
    assert [(t["name"], t["value"], t["goal"], t["met"]) for t in targets] == [
        ("mlp, 1 in flight: gateway (gRPC) p50 − Client p50 (ms)", 0.75, "<= 1", True),
        ("mlp, 1 in flight: gateway (HTTP) p50 − Client p50 (ms)", 2.5, "<= 1", False)]


def test_the_report_has_a_gateway_cpu_column_only_when_a_gateway_ran() -> None:
    plain = {"runs": [_run("asyncinfer", "mlp", 1, 2.0, worker=1.5, client=0.5)]}
    assert "| gateway |" not in markdown(plain).splitlines()[0]
    doc = {"runs": plain["runs"] + [_run("gateway", "mlp", 1, 3.0, worker=1.75, gateway=1.25)],
           "limits": {"mlp": {"1": 100.0, "32": 600.0}}}
    lines = markdown(doc).splitlines()
    assert lines[0].endswith("| CPU ms/req: worker | client | Redis | gateway |")
    assert lines[1].count("---:") == 11
    assert lines[2].endswith("| 1.0 | 1.50 | 0.50 |  |  |")  # the Client's run: no gateway
    assert lines[3] == ("| mlp | gateway | 1 | 3.0 | 0.01 | 3.00 | 3.00 | 3.00 | 1.0 | 1.75 |  |  "
                        "| 1.25 |")
