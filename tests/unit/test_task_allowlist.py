"""The task allowlist in process: the rules a device worker's task policy gives, and a model with a
preprocess but no forward inputs serving no forward stage. Real workers refusing every other task:
tests/integration/test_task_allowlist.py."""

from __future__ import annotations

from typing import Any

import pytest

from asyncinfer.constants import CONTROL_QUEUE, PREPROCESS_TASK, TASK_NAME
from asyncinfer.errors import InvalidRequest
from asyncinfer.policy.task_policy import QueueKind, TaskPolicy
from asyncinfer.wire.protocol import FORWARD_STAGE, decode_request

pytestmark = pytest.mark.timeout(180)


# -- units ------------------------------------------------------------------------------------

def test_policy_units() -> None:
    assert TaskPolicy.for_worker({"asyncinfer.cpu": "asyncinfer.cpu"}, ["mlp"]) is None
    policy = TaskPolicy.for_worker({"infer.mlp": "infer.mlp", "asyncinfer.cpu": "asyncinfer.cpu"}, ["mlp"])
    assert policy is not None
    assert policy.refusal("r", TASK_NAME, "infer.mlp") is None
    assert policy.refusal("r", PREPROCESS_TASK, "asyncinfer.cpu", lambda: "mlp") is None
    assert policy.needs_model(PREPROCESS_TASK, "asyncinfer.cpu")
    assert not policy.needs_model(PREPROCESS_TASK, "infer.mlp")
    assert policy.queue_of("forged") == ("forged", QueueKind.INFER)
    error = policy.refusal("r", PREPROCESS_TASK, "asyncinfer.cpu", lambda: None)
    assert error is not None and "it names no model" in str(error)
    with_control = TaskPolicy.for_worker({CONTROL_QUEUE: CONTROL_QUEUE}, ["mlp"])
    assert with_control is not None
    assert str(with_control.refusal("r", TASK_NAME, CONTROL_QUEUE)).startswith(
        "request r: task 'asyncinfer.infer' is refused: no task is served on queue asyncinfer.control")


def test_a_model_with_a_preprocess_and_no_forward_inputs_serves_no_forward_stage() -> None:
    from asyncinfer.models.base import InputSpec, Model

    class Tokenizing(Model):
        name = "tokenizing"
        inputs = {"text": InputSpec(("BYTES",), ())}

        def preprocess(self, batch: dict[str, Any]) -> dict[str, Any]:
            return batch

    request = decode_request("r1", {"model": "tokenizing", "parameters": {"stage": FORWARD_STAGE},
                                    "inputs": [{"name": "ids", "shape": [1], "datatype": "INT64",
                                                "data": [1]}]})
    with pytest.raises(InvalidRequest, match=r"^request r1: model 'tokenizing' declares no "
                                             r"forward_inputs"):
        Tokenizing().validate_forward(request)
