"""The bench's accelerator-shaped ``sim`` models and its in-process limit, in process."""

from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.bench.measure import model_limit
from asyncinfer.bench.synthetic import SimDevice, sim_fast, sim_prep, sim_slow
from asyncinfer.bench.workloads import WORKLOADS
from asyncinfer.models.registry import Registry

pytestmark = pytest.mark.unit


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


@pytest.mark.parametrize("name", ["sim-slow", "sim-fast", "sim-prep"])
def test_each_sim_workload_names_a_model_its_factory_makes(name: str) -> None:
    workload = WORKLOADS[name]
    model = Registry.from_config([workload.factories]).create(workload.model)
    assert model.name == name and model.options.max_batch_size == 32
