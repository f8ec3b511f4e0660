"""A model without a batch dimension (``Model.batch_dimension`` False, Triton's
``max_batch_size: 0``): its specs are whole shapes, its metadata says so, its warm-up batch is one
request of the declared shape."""

from __future__ import annotations

import pytest

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.warmup import example_batch, warmup_sizes
from asyncinfer.errors import InvalidRequest
from asyncinfer.models import InputSpec, Model, OutputSpec


class Unbatched(Model):
    name = "unbatched"
    batch_dimension = False
    inputs = {"IN": InputSpec(("INT32",), (-1,)), "WAIT": InputSpec(("UINT32",), (1,))}
    outputs = {"OUT": OutputSpec("INT32", (1,))}


def test_a_spec_without_batch_dimension_is_the_whole_shape() -> None:
    spec = InputSpec(("FP32",), (3, -1))
    spec.check("r", "x", "FP32", (3, 7), batch_dimension=False)
    with pytest.raises(InvalidRequest, match=r"input 'x': shape \[1, 3, 7\] does not match "
                                             r"\[3, any\]$"):
        spec.check("r", "x", "FP32", (1, 3, 7), batch_dimension=False)
    with pytest.raises(InvalidRequest, match=r"does not match \[n, 3, any\]$"):
        spec.check("r", "x", "FP32", (3, 7))  # with a batch dimension: [n, 3, any]


def test_its_metadata_says_max_batch_size_0_and_the_declared_shapes() -> None:
    meta = Unbatched().metadata(ModelOptions(max_batch_size=8))
    assert meta["max_batch_size"] == 0 and meta["batchable"] is False
    assert meta["batch_dimension"] is False
    assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [("IN", [-1]), ("WAIT", [1])]
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [("OUT", [1])]


def test_its_warm_up_is_one_request_of_the_declared_shapes() -> None:
    assert warmup_sizes(ModelOptions(max_batch_size=8), batchable=False) == [1]
    batch = example_batch(Unbatched(), 1)
    assert batch is not None
    assert {name: list(value.shape) for name, value in batch.items()} == {"IN": [1], "WAIT": [1]}
