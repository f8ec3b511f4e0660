"""Triton's generate extension, both ways (gateway/generate.py): a body as a call, a result as the
answer object."""

from __future__ import annotations

import json
import struct

import pytest

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.generate import generate_call, generate_response, input_shape
from asyncinfer.gateway.tensors import InferResult, OutputTensor
from asyncinfer.wire.datatypes import bytes_blob

INPUTS = [{"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]},
          {"name": "max_tokens", "datatype": "INT32", "shape": [-1, 1]},
          {"name": "weights", "datatype": "FP32", "shape": [-1, -1]}]


def _call(body: object) -> object:
    return generate_call("gen", "", json.dumps(body).encode(), INPUTS)


def test_inputs_parameters_and_id_as_triton_reads_them() -> None:
    call = _call({"id": "r-1", "text_input": "hello there", "weights": [0.5, 1.5, 2.0],
                  "temperature": 0.1, "parameters": {"max_tokens": 3, "stream": True}})
    assert (call.model, call.id, call.protocol) == ("gen", "r-1", "http")
    # keys that name inputs are tensors (also inside "parameters"), the rest parameters
    assert call.parameters == {"temperature": 0.1, "stream": True}
    tensors = {t.name: t for t in call.inputs}
    assert (tensors["text_input"].datatype, tensors["text_input"].shape) == ("BYTES", [1, 1])
    assert tensors["text_input"].raw == bytes_blob(["hello there"])
    assert (tensors["max_tokens"].shape, tensors["max_tokens"].raw) == ([1, 1], struct.pack("<i", 3))
    # the innermost variable dimension takes the elements, the other variable ones 1
    assert tensors["weights"].shape == [1, 3]
    assert tensors["weights"].raw == struct.pack("<3f", 0.5, 1.5, 2.0)


@pytest.mark.parametrize(("declared", "count", "shape"), [
    ([-1, 1], 1, [1, 1]), ([-1], 4, [4]), ([-1, -1], 5, [1, 5]), ([-1, 2], 6, [3, 2]),
    ([2, -1], 6, [2, 3]), ([], 1, []),
])
def test_shapes_are_derived_as_triton_derives_them(declared: list[int], count: int,
                                                   shape: list[int]) -> None:
    assert input_shape("x", declared, count) == shape


@pytest.mark.parametrize(("declared", "count"), [([-1, 2], 3), ([4], 3), ([], 2)])
def test_elements_that_do_not_fit_the_shape_are_refused(declared: list[int], count: int) -> None:
    with pytest.raises(InvalidRequest, match=rf"input 'x': {count} element\(s\) do not fit"):
        input_shape("input 'x'", declared, count)


@pytest.mark.parametrize(("body", "says"), [
    (b"[1, 2]", "the body must be a JSON object"),
    (b"{nope", "the body is not JSON"),
    (json.dumps({"id": 7}).encode(), "'id' must be a string"),
    (json.dumps({"id": "r", "parameters": [1]}).encode(), "request r: 'parameters' must be a JSON object"),
    (json.dumps({"id": "r", "extra": {"a": 1}}).encode(),
     "request r: 'extra' is neither an input of model 'gen'"),
    (json.dumps({"id": "r", "text_input": [["nested"]]}).encode(),
     "request r: input 'text_input': must be a string, number or boolean"),
    (json.dumps({"id": "r", "max_tokens": "many"}).encode(), "request r: input 'max_tokens'"),
    (json.dumps({"id": "r", "max_tokens": 1, "parameters": {"max_tokens": 2}}).encode(),
     "request r: input 'max_tokens' is given twice"),
])
def test_bad_bodies_are_refused_naming_the_request_and_the_rule(body: bytes, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says.replace("(", r"\(")):
        generate_call("gen", "", body, INPUTS)


def test_the_answer_has_the_ids_parameters_and_each_output_by_name() -> None:
    result = InferResult("gen", "1", "r-1", [
        OutputTensor("text_output", "BYTES", [1, 1], bytes_blob(["word"])),
        OutputTensor("scores", "FP32", [1, 2], struct.pack("<2f", 0.5, 0.25))],
        {"worker": "w1", "batch_size": 2, "nested": {"no": 1}})
    assert generate_response(result) == {
        "id": "r-1", "model_name": "gen", "model_version": "1", "worker": "w1", "batch_size": 2,
        "text_output": "word", "scores": [0.5, 0.25]}
    # no id given: none in the answer
    assert "id" not in generate_response(InferResult("gen", "1", "", []))
