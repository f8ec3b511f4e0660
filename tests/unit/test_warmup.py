"""Warm-up at worker start (engine/warmup.py): unit tier, on the CPU device."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.device import Device, parse_device
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.engine.warmup import example_batch, warm_up, warmup_sizes
from asyncinfer.models.base import Batch, InputSpec, Model


class Counting(Model):
    """Records the rows and shapes of every stage call."""

    name = "counting"
    inputs = {"x": InputSpec(("FP32",), (3, -1)), "text": InputSpec(("BYTES",), ())}

    def __init__(self) -> None:
        self.forwards: list[tuple[int, ...]] = []
        self.texts: list[list[Any]] = []

    def preprocess(self, batch: Batch) -> Batch:
        self.texts.append(list(batch["text"].reshape(-1)))
        return {"x": batch["x"]}

    def forward(self, batch: Batch) -> Batch:
        self.forwards.append(tuple(batch["x"].shape))
        return {"y": batch["x"] * 2}


def cpu() -> Device:
    return Device(parse_device("cpu"))


@pytest.mark.parametrize(("options", "batchable", "sizes"), [
    (ModelOptions(max_batch_size=32), True, [1, 2, 4, 8, 16, 32]),
    (ModelOptions(max_batch_size=24), True, [1, 2, 4, 8, 16, 24]),
    (ModelOptions(max_batch_size=1), True, [1]),
    (ModelOptions(max_batch_size=64, preferred_batch_sizes=(16, 48)), True, [16, 48, 64]),
    (ModelOptions(max_batch_size=32), False, [1]),
])
def test_the_sizes_are_the_preferred_ones_else_powers_of_two_and_the_largest(
        options: ModelOptions, batchable: bool, sizes: list[int]) -> None:
    assert warmup_sizes(options, batchable) == sizes


def test_an_example_batch_fills_each_declared_input_with_its_datatype_and_shape() -> None:
    batch = example_batch(Counting(), 4)
    assert batch is not None
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.float32
    assert tuple(batch["x"].shape) == (4, 3, 1) and float(batch["x"].abs().sum()) == 0.0
    assert [bytes(t) if not isinstance(t, str) else t.encode()
            for t in np.asarray(batch["text"], dtype=object).reshape(-1)] == [b"warm up"] * 4


def test_a_warm_up_runs_every_size_through_the_three_stages_before_serving() -> None:
    model = Counting()
    runner = ModelRunner(model, cpu(), ModelOptions(max_batch_size=8)).start()
    try:
        assert model.forwards == [(1, 3, 1), (2, 3, 1), (4, 3, 1), (8, 3, 1)]
        assert [len(t) for t in model.texts] == [1, 2, 4, 8]
    finally:
        runner.close()


def test_no_warm_up_when_turned_off_or_when_the_model_declares_no_inputs() -> None:
    model = Counting()
    assert warm_up(model, cpu(), ModelOptions(warmup=False)) == {} and model.forwards == []
    model.inputs = None
    assert warm_up(model, cpu(), ModelOptions()) == {} and model.forwards == []


def test_a_warm_up_that_raises_is_logged_and_the_sizes_after_it_are_skipped(caplog) -> None:
    class Refusing(Counting):
        def forward(self, batch: Batch) -> Batch:
            if batch["x"].shape[0] == 2:
                raise RuntimeError("no batches of two")
            return super().forward(batch)

    model = Refusing()
    with caplog.at_level(logging.WARNING, logger="asyncinfer.engine.warmup"):
        assert warm_up(model, cpu(), ModelOptions(max_batch_size=4)) == {}
    assert "model counting: warm-up raised RuntimeError: no batches of two; serving without it" \
        in caplog.text
    assert model.forwards == [(1, 3, 1)]  # the sizes after the failure are not tried
