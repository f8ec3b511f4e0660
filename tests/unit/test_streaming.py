"""A decoupled model's batches on the CPU runner, step by step (engine/streaming.py): each row's
own parts in order, the answer joined, one row per request, a row cancelled between steps, a
model that raises mid-stream, and echo-stream itself."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import Completed, settle
from asyncinfer.engine.device import Device, DeviceSpec
from asyncinfer.engine.hooks import DeviceHooks, ignore_launch
from asyncinfer.engine.limits import LimitWatch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.engine.timer import TimeLimits
from asyncinfer.errors import (
    HardTimeLimit,
    InvalidRequest,
    ModelError,
    RequestExpired,
    RequestRevoked,
    SoftTimeLimit,
)
from asyncinfer.models.base import Batch, InputSpec, Model, StreamRows, StreamStep
from asyncinfer.models.echo_stream import EchoStream
from asyncinfer.wire.protocol import Request, decode_request

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


class Counter(Model):
    """``n`` INT64 [1] per request: streams ``out`` = [[row's n, step]] for steps 1..n, so row
    ``r`` finishes at step ``n``; counts the steps it computed for each request (by its ``n``).
    A row whose ``n`` is negative raises at step 3 (poison)."""

    name = "counter"
    decoupled = True
    inputs = {"n": InputSpec(("INT64",), ())}

    def __init__(self) -> None:
        self.computed: dict[int, int] = {}
        self.batches: list[list[int]] = []

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        ns = batch["n"].tolist()
        self.batches.append(ns)
        step = 0
        while rows.live():
            step += 1
            live = rows.live()
            if step == 3 and any(ns[r] < 0 for r in live):
                raise RuntimeError("poisoned at step 3")
            for r in live:
                self.computed[ns[r]] = self.computed.get(ns[r], 0) + 1
            out = torch.tensor([[abs(ns[r]), step] for r in live])
            yield StreamStep(rows=live, outputs={"out": out},
                             done=[r for r in live if step >= abs(ns[r])])


def counter_request(n: int, request_id: str | None = None, rows: int = 1) -> Request:
    return decode_request(request_id or f"req-{n}", {"model": "counter", "inputs": [
        {"name": "n", "shape": [rows], "datatype": "INT64", "data": [n] * rows}]})


def runner_for(model: Model, *, is_revoked: Callable[[str], bool] | None = None,
               launched: list[WorkItem] | None = None) -> ModelRunner:
    options = ModelOptions(max_batch_size=8, max_delay_ms=50, warmup=False)
    hooks = DeviceHooks(on_launch=launched.extend if launched is not None else ignore_launch)
    return ModelRunner(model, Device(DeviceSpec("cpu")), options, is_revoked=is_revoked,
                       hooks=hooks)


@contextmanager
def started(runner: ModelRunner) -> Iterator[ModelRunner]:
    runner.start()
    try:
        yield runner
    finally:
        runner.close()


class Parts:
    """What each request's ``on_part`` was handed: (index, outputs as lists), in order."""

    def __init__(self) -> None:
        self.seen: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.lock = threading.Lock()

    def to(self, request_id: str, then: Callable[[int], None] | None = None
           ) -> Callable[[int, list[Any]], None]:
        def on_part(index: int, outputs: list[Any]) -> None:
            with self.lock:
                self.seen.setdefault(request_id, []).append(
                    (index, {t.name: t.value.tolist() for t in outputs}))
            if then is not None:
                then(index)
        return on_part


def submit_together(runner: ModelRunner, requests: list[Request], parts: Parts,
                    then: dict[str, Callable[[int], None]] | None = None
                    ) -> list[Future[Completed]]:
    """Submit ``requests`` so that they form one batch."""
    runner.batcher.hold()
    try:
        return [runner.submit(r, on_part=parts.to(r.id, (then or {}).get(r.id))) for r in requests]
    finally:
        runner.batcher.release()


def test_rows_finishing_at_different_steps_each_get_exactly_their_own_parts_in_order() -> None:
    model = Counter()
    parts = Parts()
    with started(runner_for(model)) as runner:
        futures = submit_together(runner, [counter_request(n) for n in (3, 1, 5, 2)], parts)
        done = [f.result(WAIT_S) for f in futures]
    assert model.batches == [[3, 1, 5, 2]]  # one batch, each row its own length
    for n, completed in zip((3, 1, 5, 2), done, strict=True):
        assert parts.seen[f"req-{n}"] == [(k, {"out": [[n, k]]}) for k in range(1, n + 1)]
        # the answer: the parts joined along the second dimension ([1, 2] each: [1, 2n])
        (out,) = completed.outputs
        assert (out.name, out.shape) == ("out", (1, 2 * n))
        assert out.value.tolist() == [[v for k in range(1, n + 1) for v in (n, k)]]
        assert completed.batch_size == 4
    assert model.computed == {3: 3, 1: 1, 5: 5, 2: 2}  # a finished row is not computed again


class Square(Model):
    """The python backend's ``square_int32``: ``n`` parts for ``n``, and none at all for 0 (the
    row is done at the first step without being handed anything)."""

    name = "counter"
    decoupled = True
    inputs = {"n": InputSpec(("INT64",), ())}

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        ns = batch["n"].tolist()
        made = [0] * len(ns)
        while rows.live():
            produced = [r for r in rows.live() if made[r] < ns[r]]
            for r in produced:
                made[r] += 1
            yield StreamStep(rows=produced, outputs={"out": torch.tensor([[ns[r]] for r in produced])},
                             done=[r for r in rows.live() if made[r] >= ns[r]])


def test_a_row_done_without_a_part_completes_with_no_outputs() -> None:
    # Given a batch whose first and last rows end at the first step with no part
    parts = Parts()
    with started(runner_for(Square())) as runner:
        futures = submit_together(runner, [counter_request(0, "none-1"), counter_request(2),
                                           counter_request(0, "none-2")], parts)
        none_1, two, none_2 = (f.result(WAIT_S) for f in futures)
    # Then each is answered (no error) with no outputs and was handed no part
    assert none_1.outputs == [] and none_2.outputs == []
    assert "none-1" not in parts.seen and "none-2" not in parts.seen
    assert none_1.batch_size == 3
    # and the other row gets its two parts, joined
    assert parts.seen["req-2"] == [(1, {"out": [[2]]}), (2, {"out": [[2]]})]
    assert two.outputs[0].value.tolist() == [[2, 2]]


def test_a_streaming_request_holds_exactly_one_row() -> None:
    with started(runner_for(Counter())) as runner, pytest.raises(InvalidRequest) as caught:
        runner.submit(counter_request(2, "two-rows", rows=2))
    assert str(caught.value) == ("request two-rows: model 'counter' streams its answers "
                                 "(decoupled): a request holds exactly one row, not 2")


@pytest.mark.parametrize("how", ["revoked", "expired", "time limit"])
def test_a_row_cancelled_between_steps_stops_at_the_next_step(how: str) -> None:
    # Given a batch of a long row (20 steps) and a short one (4), and the long one's request is
    # revoked (expired, answered by a time limit) as its 2nd part is handed over
    model = Counter()
    parts = Parts()
    revoked: set[str] = set()
    launched: list[WorkItem] = []
    futures: list[Future[Completed]] = []

    def cancel(index: int) -> None:
        if index != 2:
            return
        if how == "revoked":
            revoked.add("req-20")
        elif how == "expired":
            launched[0].deadline = 0.0
        else:
            settle(futures[0], exc=SoftTimeLimit("request req-20: soft time limit"))

    with started(runner_for(model, is_revoked=revoked.__contains__, launched=launched)) as runner:
        futures += submit_together(runner, [counter_request(20), counter_request(4)], parts,
                                   {"req-20": cancel})
        error = futures[0].exception(WAIT_S)
        short = futures[1].result(WAIT_S)
    assert [i.request.id for i in launched] == ["req-20", "req-4"]
    # Then it is answered at once and the model computes no step of it after the 2nd
    expected = {"revoked": RequestRevoked, "expired": RequestExpired,
                "time limit": SoftTimeLimit}[how]
    assert type(error) is expected, error
    if how != "time limit":
        assert str(error) == (f"request req-20: {how} while model 'counter' streamed it "
                              f"(after 2 part(s))")
    assert model.computed[20] == 2
    assert [i for i, _ in parts.seen["req-20"]] == [1, 2]
    # and the other row runs to its end
    assert [i for i, _ in parts.seen["req-4"]] == [1, 2, 3, 4]
    assert short.outputs[0].value.tolist() == [[4, 1, 4, 2, 4, 3, 4, 4]]


def test_a_model_that_raises_mid_stream_runs_each_request_alone_and_fails_only_the_bad_one() -> None:
    # Given a batch where one row poisons the model at its 3rd step
    model = Counter()
    parts = Parts()
    with started(runner_for(model)) as runner:
        futures = submit_together(runner, [counter_request(n) for n in (5, -4, 2)], parts)
        good, bad, short = (f.exception(WAIT_S) or f.result(WAIT_S) for f in futures)
    # Then the batch ran, raised, and each request ran again alone
    assert model.batches == [[5, -4, 2], [5], [-4]]  # req-2 had finished: not run again
    assert isinstance(bad, ModelError)
    assert str(bad) == ("request req--4: model 'counter' raised RuntimeError: poisoned at "
                        "step 3")
    # the rerun's parts are numbered from 1 again: a writer that keeps only those past the last
    # it wrote (the stream's append script) writes each part once
    assert [i for i, _ in parts.seen["req-5"]] == [1, 2, 1, 2, 3, 4, 5]
    written: list[tuple[int, Any]] = []
    for index, outputs in parts.seen["req-5"]:
        if not written or index > written[-1][0]:
            written.append((index, outputs))
    assert written == [(k, {"out": [[5, k]]}) for k in range(1, 6)]
    assert isinstance(good, Completed) and good.outputs[0].value.shape == (1, 10)
    assert isinstance(short, Completed) and [i for i, _ in parts.seen["req-2"]] == [1, 2]


def test_a_decoupled_request_past_its_hard_limit_fails_without_calling_the_device_wedged() -> None:
    wedged: list[WorkItem] = []
    watch = LimitWatch("counter", None, lambda: lambda item, exc: wedged.append(item),
                       decoupled=True)
    item = WorkItem(request=counter_request(3), rows=1, signature=())
    item.on_device = True
    watch._hard_limit(item, TimeLimits(soft_s=None, hard_s=1.0))  # noqa: SLF001
    assert isinstance(item.future.exception(0), HardTimeLimit)
    assert not wedged and not watch.wedged


def echo_request(request_id: str, text: str, max_tokens: int | None = None) -> Request:
    inputs = [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text]}]
    if max_tokens is not None:
        inputs.append({"name": "max_tokens", "shape": [1], "datatype": "INT32",
                       "data": [max_tokens]})
    return decode_request(request_id, {"model": "echo-stream", "inputs": inputs})


def test_echo_stream_streams_each_word_and_joins_them() -> None:
    model = EchoStream()
    model.step_s = 0.0
    parts = Parts()
    with started(runner_for(model)) as runner:
        futures = submit_together(runner, [echo_request("a", "the quick brown fox"),
                                           echo_request("b", "x y", 5)], parts)
        done = [f.result(WAIT_S) for f in futures]
    assert [w for _, o in parts.seen["a"] for w in np.ravel(o["text_output"])] == [
        "the", "quick", "brown", "fox"]
    assert [w for _, o in parts.seen["b"] for w in np.ravel(o["text_output"])] == [
        "x", "y", "x", "y", "x"]
    assert [(t.name, t.datatype, t.shape, t.value.tolist()) for t in done[0].outputs] == [
        ("text_output", "BYTES", (1,), ["the quick brown fox"])]
    assert done[1].outputs[0].value.tolist() == ["x y x y x"]
    assert {"decoupled": True}.items() <= model.metadata(runner.options).items()


@pytest.mark.parametrize(("request_", "rule"), [
    (echo_request("r", "   "), "request r: input 'text_input' holds no word"),
    (echo_request("r", "a", 0), "request r: input 'max_tokens' must be >= 1, got [0]"),
    (decode_request("r", {"model": "echo-stream", "inputs": [
        {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [2]}]}),
     "request r: model 'echo-stream' needs input 'text_input'"),
])
def test_echo_stream_refuses_what_it_cannot_stream(request_: Request, rule: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        EchoStream().validate(request_)
    assert str(caught.value).startswith(rule)


def test_echo_stream_stops_computing_a_cancelled_row() -> None:
    model = EchoStream()
    model.step_s = 0.0
    batch = {"text_input": np.array(["a b c d", "x y z"], dtype=object)}
    rows = StreamRows(2)
    steps = model.stream(batch, rows)
    first = next(steps)
    assert (list(first.rows), first.outputs["text_output"].tolist()) == ([0, 1], [["a"], ["x"]])
    rows.cancelled.add(1)
    second = next(steps)
    assert (list(second.rows), second.outputs["text_output"].tolist()) == ([0], [["b"]])
    assert Model.metadata(Counter(), ModelOptions())["decoupled"] is True


def test_a_part_that_cannot_be_handed_over_fails_its_request_only() -> None:
    model = Counter()
    parts = Parts()

    def refuse(index: int) -> None:
        if index == 2:
            raise ValueError("not encodable")

    with started(runner_for(model)) as runner:
        futures = submit_together(runner, [counter_request(4), counter_request(3)], parts,
                                  {"req-4": refuse})
        error = futures[0].exception(WAIT_S)
        other = futures[1].result(WAIT_S)
    assert str(error) == ("request req-4: part 2 of model 'counter' could not be handed over "
                          "(ValueError: not encodable)")
    assert model.computed == {4: 2, 3: 3}
    assert other.outputs[0].value.tolist() == [[3, 1, 3, 2, 3, 3]]
