"""wire/messages.task_message: the body and envelope it writes read back as what was sent (NaN
data, callbacks, either serializer, odd time limits), and the request IDs it makes are UUID4s."""

from __future__ import annotations

import base64
import json
import math
import os
import threading
import uuid
from typing import Any

import msgpack
import pytest

from asyncinfer.constants import TASK_NAME
from asyncinfer.wire.envelope import parse_envelope
from asyncinfer.wire.messages import task_message, uuid4_text
from asyncinfer.worker.requests.taken import TakenMessage

NO_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _body(raw: str) -> Any:
    envelope = json.loads(raw)
    body = base64.b64decode(envelope["body"])
    if envelope["content-type"] == "application/json":
        return json.loads(body)
    return msgpack.unpackb(body, raw=False)


def test_the_json_body_reads_back_as_the_kwargs_sent() -> None:
    kwargs = {"model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                        "data": [0.5, -1e-7, 3.0]}], "parameters": {"p": "é"}}
    assert _body(task_message(TASK_NAME, "r-1", kwargs, "infer.m")) == [[], kwargs, NO_EMBED]


def test_nan_and_infinity_in_the_data_stay_numbers_not_nulls() -> None:
    kwargs = {"model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                        "data": [float("nan"), float("inf"), None]}]}
    data = _body(task_message(TASK_NAME, "r-2", kwargs, "infer.m"))[1]["inputs"][0]["data"]
    assert math.isnan(data[0]) and data[1] == math.inf and data[2] is None


def test_callbacks_are_written_into_the_embed() -> None:
    link = {"task": "cb", "args": [], "kwargs": {}, "options": {"queue": "q"}, "subtask_type": None}
    body = _body(task_message(TASK_NAME, "r-3", {"model": "m"}, "infer.m",
                              embed={"callbacks": [link]}))
    assert body[2] == {**NO_EMBED, "callbacks": [link]}


def test_msgpack_bodies_carry_the_same_parts() -> None:
    kwargs = {"model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                                        "data": b"\x00\x00\x80?"}]}
    assert _body(task_message(TASK_NAME, "r-4", kwargs, "infer.m", serializer="msgpack")) == [
        [], kwargs, NO_EMBED]


@pytest.mark.parametrize("limits", [(30, 10.5), (None, None), (float("inf"), None)])
def test_the_envelope_parses_with_its_headers_and_time_limits(limits: tuple[Any, Any]) -> None:
    raw = task_message(TASK_NAME, "r-5", {"model": "m"}, "infer.m", time_limit_s=limits[0],
                       soft_time_limit_s=limits[1], reply_to="asyncinfer:reply:c")
    delivery = TakenMessage(raw=raw.encode(), queue="infer.m", received_at=0.0)
    parse_envelope(delivery)
    assert delivery.request_id == "r-5" and delivery.headers["task"] == TASK_NAME
    assert json.loads(raw)["headers"]["timelimit"] == list(limits)


def test_uuid4_text_is_a_random_version_4_uuid() -> None:
    ids = [uuid4_text() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for text in ids[:50]:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_uuid4_text_in_a_forked_child_is_not_its_parents_next() -> None:
    uuid4_text()  # the pool holds unused bytes now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next IDs, to the parent
        os.write(write, " ".join(uuid4_text() for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = f.read().split()
    os.waitpid(pid, 0)
    parent = [uuid4_text() for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(parent)


def test_uuid4_text_from_threads_never_repeats() -> None:
    ids: list[list[str]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=lambda out=out: out.extend(uuid4_text() for _ in range(3000)))
               for out in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for out in ids for i in out]
    assert len(every) == 12000 and len(set(every)) == 12000
