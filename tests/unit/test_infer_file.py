"""``asyncinfer infer --input-file`` in process (ops/infer_file.py), against a stub client: the
lines it sends, the order it prints them in, the line each failure gets, and a line's timeout
counted from when it was sent. The real command against a real worker: tests/integration/test_cli.py."""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import threading
import time
from typing import Any

import pytest

from asyncinfer.errors import BrokerUnavailable, InvalidRequest, ModelError, UnknownModel
from asyncinfer.ops.infer_file import infer_file


class StubResponse:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw


class StubFuture(concurrent.futures.Future):
    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.id = request_id

    def result(self, timeout: float | None = None) -> Any:
        from asyncinfer.errors import RequestTimeout

        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise RequestTimeout(f"request {self.id}: no result within {timeout:g} s") from None


class StubClient:
    """Answers each request with its inputs (a request of ``[-4]`` fails with a ModelError;
    ``answer=False``: never answers); records what was sent."""

    def __init__(self, *, answer: bool = True, declared: dict[str, str] | None = None) -> None:
        self.answer = answer
        self.declared = declared or {}
        self.sent: list[tuple[Any, dict[str, Any]]] = []

    def models(self) -> dict[str, Any]:
        inputs = [{"name": n, "datatype": d} for n, d in self.declared.items()]
        return {"m": argparse.Namespace(metadata={"inputs": inputs})}

    def check_model(self, model: str) -> None:
        if model != "m":
            raise UnknownModel(f"model {model!r} is not known")

    def submit(self, model: str, inputs: Any, *, parameters: dict[str, Any]) -> StubFuture:
        if inputs[0].get("shape") == [0]:
            raise InvalidRequest("input 'input': an empty tensor")
        self.sent.append((inputs, parameters))
        future = StubFuture(f"r{len(self.sent)}")
        if self.answer and inputs[0]["data"] == [-4]:
            future.set_exception(ModelError(f"request {future.id}: negative"))
        elif self.answer:
            future.set_result(StubResponse({"id": future.id, "data": inputs[0]["data"],
                                            "datatype": inputs[0]["datatype"]}))
        return future


def run(client: StubClient, text: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        **flags: Any) -> tuple[int, list[dict[str, Any]], list[str]]:
    monkeypatch.setattr("sys.stdin", argparse.Namespace(buffer=io.BytesIO(text.encode())))
    args = argparse.Namespace(**{"model": "m", "input_file": "-", "datatype": None, "window": 2,
                                 "progress": False, "timeout_s": 60.0, **flags})
    status = infer_file(client, args)
    out, err = capsys.readouterr()
    return status, [json.loads(line) for line in out.splitlines()], err.splitlines()


def test_every_line_is_answered_in_input_order_and_each_failure_names_its_line(monkeypatch, capsys) -> None:
    # Given five requests, two that are not requests, one the client refuses and one its model fails
    text = "\n".join(["[1]", "[2", "[[1], [2, 3]]", "", "[]", "[-4]", "[5]", "  ", '{"x": "a"}'])
    client = StubClient()

    status, answers, errors = run(client, text, monkeypatch, capsys)

    assert [a["data"] for a in answers] == [[1], [5], ["a"]]
    assert errors == [
        "asyncinfer infer: line 2: not JSON (Expecting ',' delimiter at column 3); nothing sent",
        "asyncinfer infer: line 3: not a request: InvalidRequest: tensor 'input': nested lists are "
        "ragged (rows of different lengths or depths); nothing sent",
        "asyncinfer infer: line 5: InvalidRequest: input 'input': an empty tensor; nothing sent",
        "asyncinfer infer: line 6: ModelError: request r2: negative",
    ]
    assert len(client.sent) == 4 and status == 1


def test_all_answered_is_exit_status_0_and_v2_lines_keep_their_parameters(monkeypatch, capsys) -> None:
    v2 = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [3.0]}],
          "parameters": {"priority_hint": 1}}
    client = StubClient(declared={"x": "FP32"})
    status, answers, errors = run(client, f"[1]\n{json.dumps(v2)}\n", monkeypatch, capsys)
    assert status == 0 and errors == []
    assert [(a["data"], a["datatype"]) for a in answers] == [([1.0], "FP32"), ([3.0], "FP32")]
    assert client.sent[1][1] == {"priority_hint": 1}


def test_datatype_flag_applies_to_every_line(monkeypatch, capsys) -> None:
    status, answers, _ = run(StubClient(declared={"x": "FP32"}), "[1]\n[2]\n", monkeypatch, capsys,
                             datatype="INT32")
    assert status == 0 and [a["datatype"] for a in answers] == ["INT32", "INT32"]


def test_a_line_times_out_counted_from_when_it_was_sent_not_after_the_one_before(monkeypatch,
                                                                                capsys) -> None:
    # Given a fleet that never answers, six lines in a window of three, 0.3 s each
    began = time.monotonic()
    status, answers, errors = run(StubClient(answer=False), "[1]\n" * 6, monkeypatch, capsys,
                                  timeout_s=0.3, window=3)
    # Then each times out once: two windows' worth of 0.3 s, not six lines' one after another
    assert time.monotonic() - began < 1.2
    assert status == 1 and answers == [] and len(errors) == 6
    assert errors[0] == ("asyncinfer infer: line 1: RequestTimeout: request r1: no result within "
                         "0.3 s of being sent; it may still finish (asyncinfer result r1)")


def test_an_unreachable_broker_and_an_unknown_model_end_the_run_once(monkeypatch, capsys) -> None:
    class Unreachable(StubClient):
        def submit(self, model: str, inputs: Any, *, parameters: dict[str, Any]) -> StubFuture:
            future = StubFuture("r1")
            future.set_exception(BrokerUnavailable("broker unreachable"))
            return future

    with pytest.raises(BrokerUnavailable):
        run(Unreachable(), "[1]\n[2]\n", monkeypatch, capsys)
    with pytest.raises(UnknownModel):
        run(StubClient(), "[1]\n", monkeypatch, capsys, model="n")


def test_lines_are_read_as_the_window_takes_them(monkeypatch, capsys) -> None:
    # Given stdin that yields a line only once the answer to the one before it was printed
    printed = threading.Event()

    class Gated(io.RawIOBase):
        def __init__(self) -> None:
            self.lines = [b"[1]\n", b"[2]\n"]

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            if not self.lines:
                return 0
            if len(self.lines) == 1:
                assert printed.wait(5), "the second line was read before the first was answered"
            line = self.lines.pop(0)
            buffer[:len(line)] = line
            return len(line)

    class Out(io.StringIO):
        def flush(self) -> None:
            if '"data":[1]' in self.getvalue():
                printed.set()

    out = Out()
    monkeypatch.setattr("sys.stdin", argparse.Namespace(buffer=io.BufferedReader(Gated())))
    monkeypatch.setattr("sys.stdout", out)
    args = argparse.Namespace(model="m", input_file="-", datatype=None, window=1, progress=False,
                              timeout_s=5.0)
    assert infer_file(StubClient(), args) == 0
    assert [json.loads(line)["data"] for line in out.getvalue().splitlines()] == [[1], [2]]
