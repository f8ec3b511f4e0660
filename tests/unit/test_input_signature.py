"""The client's check of a request's inputs against the signature its model announced, in process:
one set of rules and words for the worker (``Model.validate``) and the client
(client/input_check.py, wire/signature.py); what the catalogue announces for it
(``input_datatypes``); and when the client sends unchecked instead (KnownModels.signature on a
fakeredis catalogue)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import fakeredis
import numpy as np
import pytest
import redis

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.client.input_check import refuse_unfit
from asyncinfer.client.known_models import KnownModels
from asyncinfer.client.outgoing import input_payloads
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest
from asyncinfer.models.base import InputSpec, Model
from asyncinfer.models.builtin import MLP, Identity
from asyncinfer.models.echo_stream import EchoStream
from asyncinfer.models.minilm import MiniLM
from asyncinfer.wire.protocol import decode_request
from asyncinfer.wire.signature import Signature, check_tensor


class Mixed(Model):
    """Two inputs, one of several datatypes and a free dimension."""

    name = "mixed"
    inputs = {"image": InputSpec(("FP32", "FP16", "UINT8"), (3, -1), allow_nonfinite=False),
              "scale": InputSpec(("FP64",), (1,))}


class Unbatched(Model):
    name = "unbatched"
    batch_dimension = False
    inputs = {"IN": InputSpec(("INT32",), (-1,)), "WAIT": InputSpec(("UINT32",), (1,))}


def signature_of(model: Model) -> Signature:
    signature = Signature.of(model.name, model.metadata(ModelOptions()))
    assert signature is not None
    return signature


def kwargs_of(model: str, inputs: Any, binary: bool = False,
              parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``asyncinfer.infer`` kwargs a client builds for ``inputs`` (client/outgoing.py)."""
    return {"model": model, "inputs": input_payloads(inputs, binary),
            "parameters": dict(parameters or {})}


def worker_says(model: Model, request_id: str, kwargs: dict[str, Any]) -> str | None:
    """What the worker's check refuses the request with (None: it takes it)."""
    try:
        model.validate(decode_request(request_id, kwargs))
    except InvalidRequest as exc:
        return str(exc)
    return None


def client_says(signature: Signature, request_id: str, kwargs: dict[str, Any]) -> str | None:
    try:
        refuse_unfit(signature, request_id, kwargs)
    except InvalidRequest as exc:
        return str(exc)
    return None


f32, f16, f64, i64, u8 = np.float32, np.float16, np.float64, np.int64, np.uint8

CASES = [  # (model, inputs, the worker's words)
    (MLP(), np.zeros((2, 16), f32), None),
    (MLP(), np.zeros((2, 16), i64),
     "request r-1: input 'input': datatype INT64 is not accepted (accepted: FP32)"),
    (MLP(), np.zeros((2, 3), f32), "request r-1: input 'input': shape [2, 3] does not match [n, 16]"),
    (MLP(), np.zeros((16,), f32), "request r-1: input 'input': shape [16] does not match [n, 16]"),
    (MLP(), {"x": np.zeros((1, 16), f32)}, "request r-1: model 'mlp' needs input(s) 'input'; got 'x'"),
    (MLP(), {"input": np.zeros((1, 16), f32), "extra": np.zeros((1, 1), f32)},
     "request r-1: input 'extra' is not an input of model 'mlp' (inputs: 'input')"),
    (Mixed(), {"image": np.zeros((2, 3, 5), f16), "scale": np.ones((2, 1), f64)}, None),
    (Mixed(), {"image": np.zeros((2, 3, 9), u8), "scale": np.ones((2, 1), f64)}, None),
    (Mixed(), {"scale": np.ones((2, 1), f64), "image": np.zeros((2, 4, 5), f32)},
     "request r-1: input 'image': shape [2, 4, 5] does not match [n, 3, any]"),
    (Mixed(), {"image": np.zeros((2, 3, 5), f64), "scale": np.ones((2, 1), f64)},
     "request r-1: input 'image': datatype FP64 is not accepted (accepted: FP32, FP16, UINT8)"),
    (Mixed(), {"scale": np.ones((2, 1), f64)},
     "request r-1: model 'mixed' needs input(s) 'image'; got 'scale'"),
    (Unbatched(), {"IN": np.zeros((7,), np.int32), "WAIT": np.zeros((1,), np.uint32)}, None),
    (Unbatched(), {"IN": np.zeros((1, 7), np.int32), "WAIT": np.zeros((1,), np.uint32)},
     "request r-1: input 'IN': shape [1, 7] does not match [any]"),
]


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize(("model", "inputs", "says"), CASES)
def test_the_client_refuses_what_the_worker_refuses_in_its_words(
        model: Model, inputs: Any, says: str | None, binary: bool) -> None:
    kwargs = kwargs_of(model.name, inputs, binary)
    # Given the worker's own check's answer
    assert worker_says(model, "r-1", kwargs) == says
    # Then the client, from the catalogue's metadata alone, says the same (or sends it)
    assert client_says(signature_of(model), "r-1", kwargs) == says


def test_input_spec_check_keeps_its_words_through_the_shared_function() -> None:
    spec = InputSpec(("FP32", "BF16"), (4, -1))
    with pytest.raises(InvalidRequest) as caught:
        spec.check("q", "x", "INT8", (1, 4, 2))
    assert str(caught.value) == "request q: input 'x': datatype INT8 is not accepted (accepted: FP32, BF16)"
    with pytest.raises(InvalidRequest) as caught:
        check_tensor("q", "x", "BF16", (2, 4), ("FP32", "BF16"), (4, -1))
    assert str(caught.value) == "request q: input 'x': shape [2, 4] does not match [n, 4, any]"
    spec.check("q", "x", "BF16", (2, 4, 9))


def test_the_catalogue_lists_every_accepted_datatype_of_a_model_checked_as_declared() -> None:
    meta = Mixed().metadata(ModelOptions())
    # the v2 inputs keep their one datatype each; the extra key lists them all
    assert [t["datatype"] for t in meta["inputs"]] == ["FP32", "FP64"]
    assert meta["input_datatypes"] == {"image": ["FP32", "FP16", "UINT8"], "scale": ["FP64"]}
    assert MLP().metadata(ModelOptions())["input_datatypes"] == {"input": ["FP32"]}
    # a model taking any input, or with a check of its own, announces none: never checked
    assert "input_datatypes" not in Identity().metadata(ModelOptions())
    assert "input_datatypes" not in EchoStream().metadata(ModelOptions())
    assert Signature.of("echo-stream", EchoStream().metadata(ModelOptions())) is None
    assert Signature.of("identity", Identity().metadata(ModelOptions())) is None
    # one whose check is Model's and then more says so
    assert MiniLM.client_checks_inputs is True


@pytest.mark.parametrize("meta", [
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]},  # a worker from before
    {"inputs": [], "input_datatypes": {}},
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}], "input_datatypes": {"y": ["FP32"]}},
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}], "input_datatypes": {"x": ["FP32"]}},
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": "2"}], "input_datatypes": {"x": ["FP32"]}},
    {"inputs": [{"name": "x"}], "input_datatypes": {"x": ["FP32"]}},
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}], "input_datatypes": {"x": []}},
])
def test_metadata_without_a_signature_of_the_expected_form_checks_nothing(meta: dict[str, Any]) -> None:
    assert Signature.of("m", meta) is None


def test_what_the_client_cannot_judge_as_the_worker_would_is_sent() -> None:
    signature = signature_of(Mixed())
    wrong = {"image": np.zeros((1, 4, 5), f32), "scale": np.ones((1, 1), f64)}
    # a version named, or a stage: another signature may answer
    assert client_says(signature, "r", kwargs_of("mixed", wrong, parameters={"model_version": "2"})) is None
    assert client_says(signature, "r", kwargs_of("mixed", wrong, parameters={"stage": "forward"})) is None
    # v2 dicts the worker refuses for their wire form first: its words, not the signature's
    kwargs = kwargs_of("mixed", wrong)
    kwargs["inputs"][0]["data"] = kwargs["inputs"][0]["data"][:-1]
    assert "does not match" not in (worker_says(Mixed(), "r", kwargs) or "")
    assert client_says(signature, "r", kwargs) is None
    kwargs = kwargs_of("mixed", wrong, parameters={"binary_data_output": "yes"})
    assert client_says(signature, "r", kwargs) is None
    # a NaN in an earlier input that refuses it: the worker says that first
    nan = {"image": np.full((1, 3, 5), np.nan, f32), "scale": np.ones((1, 2), f64)}
    kwargs = kwargs_of("mixed", nan)
    assert "NaN and infinite values are not accepted" in (worker_says(Mixed(), "r", kwargs) or "")
    assert client_says(signature, "r", kwargs) is None
    # and nothing to check by
    assert client_says(None, "r", kwargs_of("mixed", wrong)) is None  # type: ignore[arg-type]


# -- the signature comes with the unknown-model check's read ---------------------------------------

class Counting(Catalogue):
    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.reads = 0
        self.refuse = False

    def read(self) -> Any:
        self.reads += 1
        if self.refuse:
            raise redis.ConnectionError("down")
        return super().read()


@pytest.fixture()
def catalogue() -> Iterator[Counting]:
    client = fakeredis.FakeRedis()
    yield Counting(client)
    client.close()


def test_the_signature_is_the_unknown_model_checks_read_and_lapses_with_it(
        catalogue: Counting) -> None:
    catalogue.announce("w@h", [MLP().metadata(ModelOptions()), Identity().metadata(ModelOptions())])
    known = KnownModels(catalogue, 3600)
    # Given a check that read the catalogue once
    known.check("mlp")
    assert catalogue.reads == 1
    signature = known.signature("mlp")
    assert signature is not None and signature.inputs["input"].datatypes == ("FP32",)
    assert signature.inputs["input"].row_shape == (16,)
    assert known.signature("identity") is None and known.signature("nosuch") is None
    # When checks follow within KNOWN_FOR_S, Then no read more
    known.check("mlp")
    assert known.signature("mlp") == signature and catalogue.reads == 1
    # and once the read is older than that, nothing is checked until the next read
    read_at, signatures = known._signatures
    known._signatures = (read_at - KnownModels.KNOWN_FOR_S, signatures)
    assert known.signature("mlp") is None
    # a catalogue that cannot be read checks nothing
    known.forget()
    catalogue.refuse = True
    known.check("mlp")
    assert known.signature("mlp") is None


def test_a_stale_or_versioned_entry_is_not_checked(catalogue: Counting) -> None:
    meta = MLP().metadata(ModelOptions())
    catalogue.announce("w@h", [meta, {**meta, "name": "mlp2", "versions": ["1", "2"]}])
    known = KnownModels(catalogue, 3600)
    known.check("mlp")
    assert known.signature("mlp") is not None
    assert known.signature("mlp2") is None  # two versions: either may answer
    # Given its worker gone: the model stays known, its last metadata is not checked by
    catalogue.withdraw("w@h", ["mlp"])
    known.forget()
    known.check("mlp")
    assert known.signature("mlp") is None
