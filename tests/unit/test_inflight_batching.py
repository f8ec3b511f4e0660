"""In-flight batching of a decoupled model on the CPU runner (``Model.inflight_batching``): a
request that arrives while a batch streams joins it between two steps, each row gets exactly its
own parts in order, ``max_batch_size`` bounds the live rows, a joined row cancelled stops, a batch
that raises runs each request again alone, and a model without the attribute keeps its batches
static. Order is asserted by step and part indices, never by time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.batcher import Batcher, WorkItem
from asyncinfer.engine.completion import Completed
from asyncinfer.engine.device import Device, DeviceSpec
from asyncinfer.engine.hooks import DeviceHooks
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import ModelError, RequestRevoked
from asyncinfer.models.base import Batch, InputSpec, Model, StreamRows, StreamStep
from asyncinfer.models.echo_stream import EchoStream
from asyncinfer.wire.protocol import Request, decode_request

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


class Joiner(Model):
    """``n`` INT64 [1] per request: streams ``out`` = [[n, k]] for the row's own steps k = 1..n
    (a joined row counts from its first step), so each row finishes after n parts. Logs each step
    (the ``n`` of the rows it computed) and each stream call; a row whose ``n`` is negative
    raises at its own 2nd step."""

    name = "joiner"
    decoupled = True
    inflight_batching = True
    inputs = {"n": InputSpec(("INT64",), ())}

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.steps: list[list[int]] = []
        self.computed: dict[int, int] = {}

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        ns = batch["n"].tolist()
        self.batches.append(list(ns))
        made = [0] * len(ns)
        while True:
            for indices, joined in rows.take_joined() if self.inflight_batching else ():
                assert indices == list(range(len(ns), len(ns) + len(indices)))
                ns.extend(joined["n"].tolist())
                made.extend(0 for _ in indices)
            live = rows.live()
            if not live:
                return
            self.steps.append([ns[r] for r in live])
            for r in live:
                made[r] += 1
                if ns[r] < 0 and made[r] == 2:
                    raise RuntimeError("poisoned at its 2nd step")
                self.computed[ns[r]] = self.computed.get(ns[r], 0) + 1
            out = torch.tensor([[abs(ns[r]), made[r]] for r in live])
            yield StreamStep(rows=live, outputs={"out": out},
                             done=[r for r in live if made[r] >= abs(ns[r])])


class StaticJoiner(Joiner):
    """The same model without in-flight batching (the default)."""

    name = "static-joiner"
    inflight_batching = False


def request(n: int, request_id: str | None = None) -> Request:
    return decode_request(request_id or f"req-{n}", {"model": "joiner", "inputs": [
        {"name": "n", "shape": [1], "datatype": "INT64", "data": [n]}]})


class Parts:
    """Every part handed over, in the order handed: (request id, index, outputs as lists)."""

    def __init__(self) -> None:
        self.order: list[tuple[str, int]] = []
        self.seen: dict[str, list[tuple[int, Any]]] = {}
        self.lock = threading.Lock()

    def to(self, request_id: str, then: Callable[[int], None] | None = None
           ) -> Callable[[int, list[Any]], None]:
        def on_part(index: int, outputs: list[Any]) -> None:
            with self.lock:
                self.order.append((request_id, index))
                self.seen.setdefault(request_id, []).append(
                    (index, {t.name: t.value.tolist() for t in outputs}))
            if then is not None:
                then(index)
        return on_part

    def expected(self, n: int) -> list[tuple[int, Any]]:
        return [(k, {"out": [[n, k]]}) for k in range(1, n + 1)]


class Setup:
    """A started runner of ``model`` on the CPU, what it launched, what it was told revoked."""

    def __init__(self, model: Model, max_batch_size: int = 8) -> None:
        self.launched: list[WorkItem] = []
        self.revoked: set[str] = set()
        options = ModelOptions(max_batch_size=max_batch_size, max_delay_ms=0, warmup=False)
        self.runner = ModelRunner(model, Device(DeviceSpec("cpu")), options,
                                  is_revoked=self.revoked.__contains__,
                                  hooks=DeviceHooks(on_launch=self.launched.extend))
        self.parts = Parts()
        self.futures: dict[str, Future[Completed]] = {}

    def submit(self, n: int, then: Callable[[int], None] | None = None,
               request_id: str | None = None, **how: bool) -> None:
        req = request(n, request_id)
        self.futures[req.id] = self.runner.submit(req, on_part=self.parts.to(req.id, then), **how)

    def submit_at(self, index: int, *ns: int) -> Callable[[int], None]:
        """An ``on_part`` continuation: at part ``index``, submit requests of ``ns``."""
        def then(seen: int) -> None:
            if seen == index:
                for n in ns:
                    self.submit(n)
        return then

    def __enter__(self) -> Setup:
        self.runner.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.close()


def test_a_request_arriving_while_a_batch_streams_joins_it_at_the_next_step() -> None:
    model = Joiner()
    with Setup(model) as s:
        # Given a long request (10 steps) streaming; at its 2nd part another (3 steps) arrives
        s.submit(10, s.submit_at(2, 3))
        done = {"req-10": s.futures["req-10"].result(WAIT_S)}
        done["req-3"] = s.futures["req-3"].result(WAIT_S)
    # Then the second joined the running batch (one stream call) at step 3, and all its parts
    # went out before the first's 6th: step by step, row 0 then row 1
    assert model.batches == [[10]]
    assert model.steps == [[10], [10], [10, 3], [10, 3], [10, 3], *[[10]] * 5]
    assert s.parts.order == [("req-10", 1), ("req-10", 2),
                             ("req-10", 3), ("req-3", 1), ("req-10", 4), ("req-3", 2),
                             ("req-10", 5), ("req-3", 3), *[("req-10", k) for k in range(6, 11)]]
    # each its own parts, in order, and its answer joined
    for n in (10, 3):
        assert s.parts.seen[f"req-{n}"] == s.parts.expected(n)
        (out,) = done[f"req-{n}"].outputs
        assert out.value.tolist() == [[v for k in range(1, n + 1) for v in (n, k)]]
    assert done["req-3"].batch_size == 2
    # the joined request was marked on the device as it joined (the leases' marks)
    assert [item.request.id for item in s.launched] == ["req-10", "req-3"]
    assert [item.on_device for item in s.launched] == [False, False]  # and is off it now


@pytest.mark.parametrize(("how", "joins"), [({"suspect": True}, True), ({"alone": True}, False)],
                         ids=["suspect", "alone"])
def test_a_stream_of_suspects_has_the_device_to_itself_for_its_first_step_only(
        how: dict[str, bool], joins: bool) -> None:
    # Given a request that saw a worker die on the device (a suspect: one death; alone: two)
    # streaming 6 steps; a request arrives before its first step ends, another at its 3rd part
    model = Joiner()
    with Setup(model) as s:
        first_step = threading.Event()
        go_on = threading.Event()

        def at_part(seen: int) -> None:
            if seen == 1:
                first_step.set()
                go_on.wait(WAIT_S)
            if seen == 3:
                s.submit(2, request_id="late")

        s.submit(6, at_part, request_id="suspect", **how)
        assert first_step.wait(WAIT_S)
        s.submit(3, request_id="early")
        go_on.set()
        answers = {rid: s.futures[rid].result(WAIT_S) for rid in ("suspect", "early", "late")}
    # Then nothing joined its first step (the one that was on the device at the death); a
    # suspect's stream takes requests from its 2nd step on, one that must run alone never
    assert model.steps[0] == [6]
    if joins:
        assert model.batches == [[6]]
        assert model.steps[:5] == [[6], [6, 3], [6, 3], [6, 3, 2], [6, 2]]
    else:
        assert model.batches[0] == [6] and model.steps[:6] == [[6]] * 6
    for rid, n in (("suspect", 6), ("early", 3), ("late", 2)):
        assert s.parts.seen[rid] == s.parts.expected(n)
        assert answers[rid].outputs[0].value.tolist() == [[v for k in range(1, n + 1)
                                                           for v in (n, k)]]


def test_a_joined_row_is_on_the_device_while_it_streams() -> None:
    model = Joiner()
    with Setup(model) as s:
        marks: list[tuple[int, bool]] = []

        def mark(seen: int) -> None:
            (item,) = [i for i in s.launched if i.request.id == "req-2"]
            marks.append((seen, item.on_device))

        def arrive(seen: int) -> None:
            if seen == 1:
                s.submit(2, mark)
        s.submit(6, arrive)
        s.futures["req-6"].result(WAIT_S)
        s.futures["req-2"].result(WAIT_S)
    assert marks == [(1, True), (2, True)]
    assert s.parts.seen["req-2"] == s.parts.expected(2)


def test_max_batch_size_bounds_the_live_rows_and_the_rest_join_as_rows_finish() -> None:
    model = Joiner()
    with Setup(model, max_batch_size=2) as s:
        # Given a long request streaming, and three short ones arriving at its 1st part
        def arrive(seen: int) -> None:
            if seen == 1:
                for rid in ("a", "b", "c"):
                    s.submit(2, request_id=rid)
        s.submit(10, arrive)
        answers = {rid: s.futures[rid].result(WAIT_S) for rid in ("req-10", "a", "b", "c")}
    # Then at most 2 rows ran in any step; each short one joined once a row was free
    assert model.batches == [[10]]
    assert model.steps == [[10], *[[10, 2]] * 6, *[[10]] * 3]
    assert model.computed == {10: 10, 2: 6}
    assert s.parts.seen["req-10"] == s.parts.expected(10)
    for rid in ("a", "b", "c"):
        assert s.parts.seen[rid] == s.parts.expected(2)
        assert answers[rid].outputs[0].value.tolist() == [[2, 1, 2, 2]]
    # in arrival order, each after the one before it finished
    firsts = [s.parts.order.index((rid, 1)) for rid in ("a", "b", "c")]
    lasts = [s.parts.order.index((rid, 2)) for rid in ("a", "b", "c")]
    assert firsts[0] < lasts[0] < firsts[1] < lasts[1] < firsts[2] < lasts[2]
    assert lasts[2] < s.parts.order.index(("req-10", 10))


def test_a_joined_row_revoked_mid_stream_stops_and_the_others_run_on() -> None:
    model = Joiner()
    with Setup(model) as s:
        def revoke_at_2(seen: int) -> None:
            if seen == 2:
                s.revoked.add("req-30")

        def arrive(seen: int) -> None:
            if seen == 1:
                s.submit(30, revoke_at_2)
        s.submit(8, arrive)
        s.futures["req-8"].result(WAIT_S)
        error = s.futures["req-30"].exception(WAIT_S)
    assert type(error) is RequestRevoked, error
    assert str(error) == "request req-30: revoked while model 'joiner' streamed it (after 2 part(s))"
    assert model.batches == [[8]]
    assert model.computed[30] == 2
    assert [i for i, _ in s.parts.seen["req-30"]] == [1, 2]
    assert s.parts.seen["req-8"] == s.parts.expected(8)


def test_a_request_revoked_while_waiting_to_join_never_runs() -> None:
    model = Joiner()
    with Setup(model) as s:
        def arrive(seen: int) -> None:
            if seen == 1:
                s.revoked.add("req-4")
                s.submit(4)
        s.submit(5, arrive)
        s.futures["req-5"].result(WAIT_S)
        error = s.futures["req-4"].exception(WAIT_S)
    assert type(error) is RequestRevoked
    assert str(error) == "request req-4: revoked before it reached the device"
    assert 4 not in model.computed
    assert [item.request.id for item in s.launched] == ["req-5"]


def test_a_batch_that_raises_after_a_row_joined_runs_each_request_again_alone() -> None:
    model = Joiner()
    with Setup(model) as s:
        # Given a joined row that poisons the model at its own 2nd step (3rd of the batch); a
        # third request arrives during the rerun
        arrivals = iter([-4, 2])

        def arrive(seen: int) -> None:
            if seen == 2:
                s.submit(next(arrivals))
        s.submit(6, arrive)
        good = s.futures["req-6"].result(WAIT_S)
        bad = s.futures["req--4"].exception(WAIT_S)
        late = s.futures["req-2"].result(WAIT_S)
    # Then each ran again alone (the rerun takes no joiners: the late one waited for its own
    # batch), and the bad one fails only itself
    assert model.batches == [[6], [6], [-4], [2]]
    assert late.outputs[0].value.tolist() == [[2, 1, 2, 2]]
    assert isinstance(bad, ModelError)
    assert str(bad) == "request req--4: model 'joiner' raised RuntimeError: poisoned at its 2nd step"
    assert good.outputs[0].value.tolist() == [[v for k in range(1, 7) for v in (6, k)]]
    assert [i for i, _ in s.parts.seen["req-6"]] == [1, 2, 3, 1, 2, 3, 4, 5, 6]


def test_a_model_without_in_flight_batching_keeps_its_batches_static() -> None:
    model = StaticJoiner()
    with Setup(model) as s:
        s.submit(6, s.submit_at(2, 3))
        s.futures["req-6"].result(WAIT_S)
        s.futures["req-3"].result(WAIT_S)
    # the second waited for the first batch to end, and ran in a batch of its own
    assert model.batches == [[6], [3]]
    assert s.parts.order == [*[("req-6", k) for k in range(1, 7)],
                             *[("req-3", k) for k in range(1, 4)]]
    assert s.parts.seen["req-3"] == s.parts.expected(3)


def test_stream_rows_join_appends_rows_and_the_model_takes_them_once() -> None:
    rows = StreamRows(2)
    rows.cancelled.add(0)
    assert rows.join({"n": torch.tensor([7, 8])}) == [2, 3]
    assert rows.join({"t": np.array(["x"], dtype=object)}) == [4]
    assert rows.size == 5 and rows.live() == [1, 2, 3, 4]
    taken = rows.take_joined()
    assert [(indices, sorted(inputs)) for indices, inputs in taken] == [([2, 3], ["n"]),
                                                                       ([4], ["t"])]
    assert rows.take_joined() == []
    with pytest.raises(ValueError, match="one number"):
        rows.join({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_echo_stream_takes_joined_rows_at_its_next_step() -> None:
    model = EchoStream()
    model.step_s = 0.0
    assert EchoStream.inflight_batching is True and Model.inflight_batching is False
    rows = StreamRows(1)
    steps = model.stream({"text_input": np.array(["a b c d"], dtype=object)}, rows)
    first = next(steps)
    assert (list(first.rows), first.outputs["text_output"].tolist()) == ([0], [["a"]])
    assert rows.join({"text_input": np.array(["x y"], dtype=object),
                      "max_tokens": np.array([3], dtype=np.int32)}) == [1]
    second = next(steps)
    assert (list(second.rows), second.outputs["text_output"].tolist(), list(second.done)) == (
        [0, 1], [["b"], ["x"]], [])
    third = next(steps)
    assert third.outputs["text_output"].tolist() == [["c"], ["y"]]
    fourth = next(steps)
    assert (fourth.outputs["text_output"].tolist(), list(fourth.done)) == ([["d"], ["x"]], [0, 1])


def _item(name: str, signature: str, priority: int = 0, alone: bool = False) -> WorkItem:
    return WorkItem(request=request(1, name), rows=1, signature=signature, priority=priority,
                    alone=alone)


def test_take_joining_takes_compatible_requests_in_order_up_to_the_first_that_cannot_join() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    for name, sig in (("a", "A"), ("b", "A"), ("c", "B"), ("d", "A")):
        batcher.put(_item(name, sig))
    # another signature leads after b: d waits behind c (c would be served before it)
    assert [i.request.id for i in batcher.take_joining("A", 8)] == ["a", "b"]
    assert batcher.take_joining("A", 8) == []
    assert sorted(batcher.waiting_ids()) == ["c", "d"]
    # the room bounds what joins
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    for name in "abc":
        batcher.put(_item(name, "A"))
    assert [i.request.id for i in batcher.take_joining("A", 2)] == ["a", "b"]
    assert batcher.take_joining("A", 0) == []
    assert [i.request.id for i in batcher.take_joining("A", 1)] == ["c"]
    # one that runs alone is not taken, nor what waits behind it
    batcher.put(_item("x", "A", alone=True))
    batcher.put(_item("y", "A"))
    assert batcher.take_joining("A", 8) == []
    assert [i.request.id for i in batcher.next_batch() or []] == ["x"]


def test_take_joining_respects_priorities() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    batcher.put(_item("low", "A", priority=5))
    batcher.put(_item("urgent-b", "B", priority=0))
    # the more urgent request of another signature is served first: nothing joins
    assert batcher.take_joining("A", 8) == []
    batcher.put(_item("urgent-a", "A", priority=0))
    # urgent-b still leads (it arrived first at the best level)
    assert batcher.take_joining("A", 8) == []
    assert [i.request.id for i in batcher.next_batch() or []] == ["urgent-b"]
    assert [i.request.id for i in batcher.take_joining("A", 8)] == ["urgent-a", "low"]
