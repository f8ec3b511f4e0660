"""The ``graph_batch_sizes`` option (engine/graphs.py): unit tier, on the CPU device. The capture
and replay on a device are tested on the simulated NPU (tests/integration/test_npu_graphs.py);
here the option's checks, the size chosen, the padding and cutting around a replay (with a
stand-in graph), and what a CPU worker does with the option."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.config.settings import Settings
from asyncinfer.engine import runner as runner_module
from asyncinfer.engine.device import Device, parse_device
from asyncinfer.engine.graphs import (
    CapturedGraph,
    GraphSet,
    NotGraphable,
    capture_graphs,
    check_graphable,
    graph_size,
)
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.models.base import Batch, InputSpec, Model
from asyncinfer.models.builtin import MLP, Identity
from asyncinfer.models.minilm import MiniLM
from asyncinfer.wire.protocol import decode_request
from tests.support.models import Affine3

RULE = ("graph_batch_sizes needs a forward whose inputs are declared with a fixed row shape and a "
        "numeric datatype (one graph per batch size holds fixed shapes)")


def cpu() -> Device:
    return Device(parse_device("cpu"))


class Doubler:
    """Stands in for a captured graph: a replay doubles the static input into the static output,
    all rows, as a graph of that size does; it remembers what each replay saw."""

    def __init__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        self.inputs, self.outputs = inputs, outputs
        self.seen: list[torch.Tensor] = []

        self.threads: list[str] = []

    def replay(self) -> None:
        self.seen.append(self.inputs["x"].clone())
        self.threads.append(threading.current_thread().name)
        torch.mul(self.inputs["x"], 2, out=self.outputs["y"])


def doubler_set(*sizes: int) -> tuple[GraphSet, dict[int, Doubler]]:
    graphs, doublers = [], {}
    for size in sizes:
        inputs = {"x": torch.full((size, 3), 7.0)}  # what an earlier batch left there
        outputs = {"y": torch.zeros(size, 3)}
        doublers[size] = Doubler(inputs, outputs)
        graphs.append(CapturedGraph(size, doublers[size], inputs, outputs))
    return GraphSet(graphs, cpu()), doublers


@pytest.mark.parametrize(("rows", "size"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8),
                                            (9, None)])
def test_a_batch_gets_the_smallest_size_that_holds_it(rows: int, size: int | None) -> None:
    assert graph_size(rows, [1, 2, 4, 8]) == size


def test_a_batch_is_copied_into_the_graph_padded_with_zeros_and_its_outputs_cut_to_its_rows() -> None:
    graphs, doublers = doubler_set(2, 4)
    x = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    out = graphs.run({"x": x})
    assert out is not None
    # Then: the graph of 4 ran on the batch's 3 rows and one row of zeros (not the 7s left there)
    assert len(doublers[4].seen) == 1 and doublers[2].seen == []
    torch.testing.assert_close(doublers[4].seen[0], torch.cat([x, torch.zeros(1, 3)]))
    # and only the batch's rows come out
    torch.testing.assert_close(out["y"], x * 2)


def test_a_batch_the_graphs_cannot_hold_runs_eager() -> None:
    graphs, doublers = doubler_set(2, 4)
    assert graphs.run({"x": torch.ones(5, 3)}) is None  # more rows than the largest
    assert graphs.run({"x": torch.ones(2, 4)}) is None  # another row shape
    assert graphs.run({"x": torch.ones(2, 3, dtype=torch.float64)}) is None  # another datatype
    assert graphs.run({"z": torch.ones(2, 3)}) is None  # another input
    assert graphs.run({}) is None
    assert doublers[2].seen == [] and doublers[4].seen == []


class Text(Model):
    name = "text"
    inputs = {"text": InputSpec(("BYTES",), ())}


class OwnPreprocess(Model):
    name = "own-preprocess"
    inputs = {"input": InputSpec(("FP32",), (1,))}

    def preprocess(self, batch: Batch) -> Batch:
        return batch


@pytest.mark.parametrize(("model", "why"), [
    (Identity(), "it declares no inputs"),
    (MiniLM(), "input 'input_ids' is [n, any]"),
    (Text(), "input 'text' is BYTES"),
    (OwnPreprocess(), "it has its own preprocess and declares no forward_inputs"),
])
def test_a_model_no_graph_can_hold_is_refused_with_the_rule(model: Model, why: str) -> None:
    with pytest.raises(NotGraphable) as caught:
        check_graphable(model)
    assert str(caught.value) == f"model '{model.name}': {RULE}; {why}"


@pytest.mark.parametrize("model", [MLP(), Affine3()])
def test_a_forward_of_fixed_numeric_inputs_can_be_graphed(model: Model) -> None:
    check_graphable(model)  # MLP's inputs; Affine3's forward_inputs (it has its own preprocess)


def test_on_cpu_the_option_is_ignored_with_one_line_and_the_model_serves_eager(
        caplog: pytest.LogCaptureFixture) -> None:
    options = ModelOptions(max_batch_size=8, graph_batch_sizes=(2, 4))
    with caplog.at_level(logging.INFO, logger="asyncinfer.engine.graphs"):
        runner = ModelRunner(MLP(), cpu(), options).start()
    try:
        assert runner.graphs == []
        assert [r.getMessage() for r in caplog.records] == [
            "model mlp: graph_batch_sizes [2, 4] ignored on cpu (graphs are captured on cuda and "
            "npu only); running eager"]
        x = np.random.default_rng(0).standard_normal((3, MLP.in_features)).astype(np.float32)
        request = decode_request("r1", {"model": "mlp", "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [3, MLP.in_features],
             "data": x.reshape(-1).tolist()}]})
        done = runner.submit(request).result(timeout=30)
        with torch.no_grad():
            expected = MLP().net(torch.from_numpy(x))
        [output] = done.outputs
        assert output.name == "output" and done.batch_size == 3
        torch.testing.assert_close(output.value, expected)
    finally:
        runner.close()


def test_the_rule_is_checked_on_cpu_too() -> None:
    # a configuration that would be refused on an accelerator is refused on a CPU box first
    with pytest.raises(NotGraphable, match="model 'identity'"):
        capture_graphs(Identity(), cpu(), ModelOptions(graph_batch_sizes=(1,)))
    assert capture_graphs(Identity(), cpu(), ModelOptions()) == []  # the option off: no check


def test_the_option_is_configured_as_a_sorted_list_of_sizes_within_max_batch_size() -> None:
    settings = Settings(model_options=json.dumps(
        {"*": {"max_batch_size": 16}, "mlp": {"graph_batch_sizes": [8, 1, 4, 4]}}))
    assert settings.options_for("mlp", ModelOptions()).graph_batch_sizes == (1, 4, 8)
    assert settings.options_for("identity", ModelOptions()).graph_batch_sizes == ()
    for bad in ([0], [17], [2.0], [True], "4", 4):
        with pytest.raises(ValueError) as caught:
            ModelOptions(max_batch_size=16).merged({"graph_batch_sizes": bad})
        assert str(caught.value).startswith("graph_batch_sizes must be integers in "
                                            "1..max_batch_size (16), got ")


def test_a_model_that_runs_rows_one_by_one_gets_a_graph_of_one_row() -> None:
    class Single(MLP):
        batchable = False

    options: Any = ModelOptions(max_batch_size=8, graph_batch_sizes=(2, 4))
    assert ModelRunner(Single(), cpu(), options).options.graph_batch_sizes == (1,)
    assert ModelRunner(Single(), cpu(), ModelOptions()).options.graph_batch_sizes == ()


class Twice(Model):
    """``x`` FP32 [n, 3] → ``y`` = 2x; counts its eager forwards."""

    name = "twice"
    inputs = {"x": InputSpec(("FP32",), (3,))}

    def __init__(self) -> None:
        self.eager_rows: list[int] = []

    def forward(self, batch: Batch) -> Batch:
        self.eager_rows.append(len(batch["x"]))
        return {"y": batch["x"] * 2}


@pytest.mark.parametrize("pipelined", [True, False])
def test_each_instance_replays_its_own_graphs_and_larger_batches_run_eager(
        monkeypatch: pytest.MonkeyPatch, pipelined: bool) -> None:
    # Given: two instances, each with its own stand-in graphs of 2 and 4 rows
    sets = [doubler_set(2, 4) for _ in range(2)]
    monkeypatch.setattr(runner_module, "capture_graphs", lambda *_: [s for s, _ in sets])
    model = Twice()
    options = ModelOptions(max_batch_size=8, instances=2, pipelined=pipelined, warmup=False)
    runner = ModelRunner(model, cpu(), options).start()
    try:
        # When: requests run one at a time (each its own batch)
        for i, rows in enumerate([3, 1, 6, 4]):
            x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + i
            request = decode_request(f"r{i}", {"model": "twice", "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [rows, 3],
                 "data": x.reshape(-1).tolist()}]})
            [output] = runner.submit(request).result(timeout=30).outputs
            torch.testing.assert_close(output.value, x * 2)  # its own rows, none of the padding
    finally:
        runner.close()
    # Then: 3, 1 and 4 rows replayed a graph (4, 2 and 4), 6 rows ran eager
    assert model.eager_rows == [6]
    replayed = sorted(len(seen) for _, doublers in sets for d in doublers.values()
                      for seen in d.seen)
    assert replayed == [2, 4, 4]
    # each set replayed only by its own instance's thread
    stage = "device" if pipelined else "serial"
    for i, (_, doublers) in enumerate(sets):
        assert {t for d in doublers.values() for t in d.threads} <= {f"{stage}-twice-{i}"}
