"""A model file's signature (models/files.py, models/program_signature.py): read from a
torch.export program's graph or a TorchScript forward's schema, or given; the requests it refuses
(InvalidRequest: HTTP 400), the order its program gets inputs in, its warm-up and its batch range.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.device import Device, parse_device
from asyncinfer.engine.warmup import example_batch, warm_up
from asyncinfer.errors import InvalidRequest
from asyncinfer.models.base import InputSpec, OutputSpec
from asyncinfer.models.files import FileModel
from asyncinfer.models.program_signature import NUMERIC_DATATYPES, AnyShape
from asyncinfer.wire.protocol import decode_request

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")]

CPU = torch.device("cpu")


class Pair(torch.nn.Module):
    """Two inputs of two datatypes, two outputs: ``features`` FP32 [n, 4], ``ids`` INT64 [n, 3]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, features: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(features), ids * 2


class Difference(torch.nn.Module):
    """``minuend - subtrahend``: which input is which shows in the answer."""

    def forward(self, minuend: torch.Tensor, subtrahend: torch.Tensor) -> torch.Tensor:
        return minuend - subtrahend


class Tokens(torch.nn.Module):
    """``tokens`` INT64 [n, any] → ``lengths`` FP32 [n] (a dynamic size past the batch's)."""

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"lengths": (tokens != 0).sum(1).float()}


def _pair_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 4), torch.arange(rows * 3, dtype=torch.int64).reshape(rows, 3)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pair`` (.pt2: dynamic batch, static feature sizes; .pt), ``difference`` (.pt2, .pt),
    ``tokens.pt2`` (a dynamic second size), ``ranged.pt2`` (2 to 3 rows a call) and
    ``static.pt2`` (exported for one row, no dynamic size)."""
    folder = tmp_path_factory.mktemp("files")
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.export.save(torch.export.export(Pair(), _pair_inputs(2), dynamic_shapes=(
        {0: batch}, {0: batch})), str(folder / "pair.pt2"))
    torch.jit.script(Pair()).save(str(folder / "pair.pt"))
    two = (torch.randn(2, 3), torch.randn(2, 3))
    torch.export.save(torch.export.export(Difference(), two, dynamic_shapes=(
        {0: batch}, {0: batch})), str(folder / "difference.pt2"))
    torch.jit.script(Difference()).save(str(folder / "difference.pt"))
    length = torch.export.Dim("length", min=1, max=512)
    torch.export.save(torch.export.export(Tokens(), (torch.ones(2, 5, dtype=torch.int64),),
                                          dynamic_shapes=({0: batch, 1: length},)),
                      str(folder / "tokens.pt2"))
    few = torch.export.Dim("few", min=2, max=3)
    torch.export.save(torch.export.export(Pair(), _pair_inputs(2), dynamic_shapes=(
        {0: few}, {0: few})), str(folder / "ranged.pt2"))
    torch.export.save(torch.export.export(Pair(), _pair_inputs(1)), str(folder / "static.pt2"))
    return folder


def loaded(folder: Path, file: str, **given: Any) -> FileModel:
    model = FileModel(file.split(".")[0], folder / file, **given)
    model.load(CPU)
    return model


def tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    count = 1
    for d in shape:
        count *= d
    element: Any = {"BYTES": "x", "BOOL": False}.get(datatype, 1)
    return {"name": name, "datatype": datatype, "shape": shape, "data": [element] * count}


def refusal(model: FileModel, *inputs: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as info:
        model.validate(decode_request("r1", {"model": model.name, "inputs": list(inputs)}))
    return str(info.value)


# -- the signature ------------------------------------------------------------------------------

def test_an_exported_programs_signature_is_read_from_its_graph(files: Path) -> None:
    # Given an exported program with a dynamic batch and static feature sizes, two in, two out
    model = loaded(files, "pair.pt2")
    # Then its inputs are the forward's arguments, by datatype and row shape
    assert model.inputs == {"features": InputSpec(("FP32",), (4,)),
                            "ids": InputSpec(("INT64",), (3,))}
    assert model.outputs == {"output_0": OutputSpec("FP32", (2,)),
                             "output_1": OutputSpec("INT64", (3,))}
    # and the catalogue shows them, with the batch dimension as -1, as a torch.export program
    meta = model.metadata(ModelOptions())
    assert meta["platform"] == "torch_export"
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "ids", "datatype": "INT64", "shape": [-1, 3]}]
    assert meta["outputs"] == [{"name": "output_0", "datatype": "FP32", "shape": [-1, 2]},
                               {"name": "output_1", "datatype": "INT64", "shape": [-1, 3]}]


def test_a_dynamic_size_past_the_batch_is_any_and_a_dicts_keys_name_the_outputs(
        files: Path) -> None:
    model = loaded(files, "tokens.pt2")
    assert model.inputs == {"tokens": InputSpec(("INT64",), (-1,))}
    assert model.outputs == {"lengths": OutputSpec("FP32", ())}
    # a warm-up example takes size 1 for it
    batch = example_batch(model, 4)
    assert batch is not None and list(batch["tokens"].shape) == [4, 1]


def test_a_torchscript_programs_inputs_are_its_forwards_argument_names(files: Path) -> None:
    model = loaded(files, "pair.pt")
    assert model.inputs == {"features": AnyShape(NUMERIC_DATATYPES, ()),
                            "ids": AnyShape(NUMERIC_DATATYPES, ())}
    assert model.outputs is None
    meta = model.metadata(ModelOptions())
    assert meta["platform"] == "pytorch_libtorch"
    assert [t["name"] for t in meta["inputs"]] == ["features", "ids"] and meta["outputs"] == []
    # its shapes are not known: any shape and datatype of a tensor passes, BYTES does not
    model.validate(decode_request("ok", {"model": "pair", "inputs": [
        tensor("ids", "INT8", [2, 5, 5]), tensor("features", "FP16", [7])]}))


# -- mistakes: InvalidRequest naming the input and the rule ---------------------------------------

@pytest.mark.parametrize(("inputs", "message"), [
    ([tensor("input", "FP32", [2, 4]), tensor("ids", "INT64", [2, 3])],
     "request r1: model 'pair' needs input(s) 'features'; got 'ids', 'input'"),
    ([tensor("features", "FP32", [2, 4])],
     "request r1: model 'pair' needs input(s) 'ids'; got 'features'"),
    ([tensor("features", "FP32", [2, 4]), tensor("ids", "INT64", [2, 3]),
      tensor("mask", "BOOL", [2, 3])],
     "request r1: input 'mask' is not an input of model 'pair' (inputs: 'features', 'ids')"),
    ([tensor("features", "INT64", [2, 4]), tensor("ids", "INT64", [2, 3])],
     "request r1: input 'features': datatype INT64 is not accepted (accepted: FP32)"),
    ([tensor("features", "FP32", [2, 5]), tensor("ids", "INT64", [2, 3])],
     "request r1: input 'features': shape [2, 5] does not match [n, 4]"),
    ([tensor("features", "FP32", [2, 4]), tensor("ids", "INT64", [2, 3, 1])],
     "request r1: input 'ids': shape [2, 3, 1] does not match [n, 3]"),
])
def test_an_exported_program_refuses_a_request_that_does_not_fit(
        files: Path, inputs: list[dict[str, Any]], message: str) -> None:
    assert refusal(loaded(files, "pair.pt2"), *inputs) == message


@pytest.mark.parametrize(("inputs", "message"), [
    ([tensor("input", "FP32", [2, 4]), tensor("ids", "INT64", [2, 3])],
     "request r1: model 'pair' needs input(s) 'features'; got 'ids', 'input'"),
    ([tensor("features", "FP32", [2, 4])],
     "request r1: model 'pair' needs input(s) 'ids'; got 'features'"),
    ([tensor("features", "FP32", [2, 4]), tensor("ids", "INT64", [2, 3]),
      tensor("mask", "BOOL", [2, 3])],
     "request r1: input 'mask' is not an input of model 'pair' (inputs: 'features', 'ids')"),
    ([tensor("features", "BYTES", [2]), tensor("ids", "INT64", [2, 3])],
     f"request r1: input 'features': datatype BYTES is not accepted (accepted: "
     f"{', '.join(NUMERIC_DATATYPES)})"),
])
def test_a_torchscript_program_refuses_wrong_names_counts_and_bytes(
        files: Path, inputs: list[dict[str, Any]], message: str) -> None:
    assert refusal(loaded(files, "pair.pt"), *inputs) == message


# -- the program's arguments ----------------------------------------------------------------------

@pytest.mark.parametrize("file", ["difference.pt2", "difference.pt"])
def test_the_program_gets_its_inputs_in_the_declared_order_whatever_the_requests(
        files: Path, file: str) -> None:
    model = loaded(files, file)
    assert list(model.inputs or {}) == ["minuend", "subtrahend"]
    # When the request lists them the other way round
    request = decode_request("r", {"model": "difference", "inputs": [
        {"name": "subtrahend", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]},
        {"name": "minuend", "datatype": "FP32", "shape": [1, 3], "data": [10.0, 10.0, 10.0]}]})
    model.validate(request)
    out = model.forward({t.name: t.value for t in request.inputs})
    # Then each input went to its own argument
    assert out["output"].tolist() == [[9.0, 8.0, 7.0]]


@pytest.mark.parametrize("file", ["ranged.pt2", "static.pt2"])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_a_program_made_for_a_range_of_rows_takes_any_batch_in_pieces(
        files: Path, file: str, rows: int) -> None:
    # Given programs made for 2 to 3 rows a call, and for exactly 1
    model = loaded(files, file)
    features, ids = _pair_inputs(rows)
    # When a batch of any size runs, Then its answers are the module's, row for row
    with torch.inference_mode():
        out = model.forward({"ids": ids, "features": features})
        expected = Pair()(features, ids)
    assert {n: tuple(v.shape) for n, v in out.items()} == {"output_0": (rows, 2),
                                                          "output_1": (rows, 3)}
    torch.testing.assert_close(out["output_0"], expected[0])
    assert torch.equal(out["output_1"], expected[1])


def test_given_inputs_and_outputs_are_the_signature_mapped_by_position(files: Path) -> None:
    # Given a signature as a model repository's config.pbtxt would give it
    inputs = {"INPUT__0": InputSpec(("FP32",), (4,)), "INPUT__1": InputSpec(("INT64",), (3,))}
    outputs = {"OUTPUT__0": OutputSpec("FP32", (2,)), "OUTPUT__1": OutputSpec("INT64", (3,))}
    for file in ("pair.pt2", "pair.pt"):
        model = loaded(files, file, inputs=inputs, outputs=outputs)
        assert (model.inputs, model.outputs) == (inputs, outputs)
        features, ids = _pair_inputs(2)
        out = model.forward({"INPUT__1": ids, "INPUT__0": features})
        assert list(out) == ["OUTPUT__0", "OUTPUT__1"] and torch.equal(out["OUTPUT__1"], ids * 2)


def test_without_a_batch_dimension_the_shapes_are_whole_and_a_batch_is_not_split(
        files: Path) -> None:
    # Given a program exported for one row, hosted as Triton's max_batch_size 0 would
    model = FileModel("static", files / "static.pt2")
    model.batch_dimension = False
    model.load(CPU)
    # Then its inputs and outputs are declared by their whole shapes
    assert model.inputs == {"features": InputSpec(("FP32",), (1, 4)),
                            "ids": InputSpec(("INT64",), (1, 3))}
    assert model.outputs == {"output_0": OutputSpec("FP32", (1, 2)),
                             "output_1": OutputSpec("INT64", (1, 3))}
    assert refusal(model, tensor("features", "FP32", [2, 4]), tensor("ids", "INT64", [1, 3])) == (
        "request r1: input 'features': shape [2, 4] does not match [1, 4]")


def test_given_inputs_not_as_many_as_the_programs_arguments_are_refused_at_load(
        files: Path) -> None:
    model = FileModel("pair", files / "pair.pt2", inputs={"x": InputSpec(("FP32",), (4,))})
    with pytest.raises(ValueError) as info:
        model.load(CPU)
    assert str(info.value) == (f"model 'pair': {files / 'pair.pt2'} declares 1 input(s) (x); its "
                               f"program takes 2 (features, ids)")


def test_a_program_without_a_signature_takes_inputs_in_request_order(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Given a TorchScript forward with an int argument and no default
    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, times: int) -> torch.Tensor:
            return x * times

    torch.jit.script(Scaled()).save(str(tmp_path / "scaled.pt"))
    with caplog.at_level(logging.WARNING, logger="asyncinfer.models.files"):
        model = loaded(tmp_path, "scaled.pt")
    assert model.inputs is None
    assert (f"model scaled: no signature read from {tmp_path / 'scaled.pt'}: its argument 'times' "
            f"(int) is not a tensor and has no default") in caplog.text


# -- warm-up --------------------------------------------------------------------------------------

def test_a_derived_signature_is_warmed_up_and_a_torchscript_one_is_not(files: Path) -> None:
    device = Device(parse_device("cpu"))
    options = ModelOptions(max_batch_size=4)
    assert sorted(warm_up(loaded(files, "pair.pt2"), device, options)) == [1, 2, 4]
    assert sorted(warm_up(loaded(files, "tokens.pt2"), device, options)) == [1, 2, 4]
    torchscript = loaded(files, "pair.pt")
    assert example_batch(torchscript, 1) is None
    assert warm_up(torchscript, device, options) == {}
