"""Sequence batching's pure parts: the sequence parameters, a stateful model's declaration, the
worker's sequence book (order, one request per sequence in flight, state, release), a stateful
model's runner on the CPU, and the publish script's routing (fakeredis)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import fakeredis
import pytest
import torch

from asyncinfer.broker.publisher import Publisher, script_arguments, worker_of_pin
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.constants import queue_for, sequence_list
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.device import Device, DeviceSpec
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.engine.sequences import SequenceBook
from asyncinfer.errors import (
    InvalidRequest,
    SequenceNotStarted,
    SequenceStateLost,
    SequenceUnavailable,
)
from asyncinfer.models.base import Batch
from asyncinfer.models.sequence import SequenceBatching, SequenceState
from asyncinfer.wire.keys import SEQUENCE_MODELS_KEY, sequence_pin_key, sequence_workers_key
from asyncinfer.wire.protocol import Request, decode_request
from asyncinfer.wire.sequence import SequenceFlags, sequence_of
from tests.support.sequence_models import Accumulator

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


# -- the parameters --------------------------------------------------------------------------------

def test_sequence_parameters_read_as_triton_sends_them() -> None:
    assert sequence_of({}) is None
    assert sequence_of({"sequence_id": 0, "sequence_start": False}) is None  # 0: no sequence
    assert sequence_of({"sequence_id": ""}) is None
    flags = sequence_of({"sequence_id": 1000, "sequence_start": True})
    assert flags == SequenceFlags(1000, start=True, end=False) and flags.key == "u1000"
    text = sequence_of({"sequence_id": "1000", "sequence_end": True})
    assert text == SequenceFlags("1000", end=True) and text.key == "s1000"  # typed, as in Triton
    assert sequence_of({"sequence_id": 2 ** 64 - 1}).id == 2 ** 64 - 1


@pytest.mark.parametrize(("parameters", "words"), [
    ({"sequence_id": -1}, "unsigned 64-bit integer"),
    ({"sequence_id": 2 ** 64}, "unsigned 64-bit integer"),
    ({"sequence_id": True}, "unsigned 64-bit integer"),
    ({"sequence_id": 1.5}, "unsigned 64-bit integer"),
    ({"sequence_id": "a\nb"}, "printable"),
    ({"sequence_id": 7, "sequence_start": 1}, "'sequence_start' must be a boolean"),
    ({"sequence_start": True}, "'sequence_start' needs a non-zero 'sequence_id'"),
])
def test_bad_sequence_parameters_are_refused_by_name(parameters: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        sequence_of(parameters, "request r1")


# -- the declaration -------------------------------------------------------------------------------

def test_controls_are_one_value_a_row_in_the_declared_datatypes() -> None:
    spec = SequenceBatching(start="S", end="E", ready="R", corrid="C", control_datatype="FP32")
    controls = spec.controls([SequenceFlags(5, start=True), SequenceFlags(9, end=True)])
    assert controls["S"].dtype == torch.float32 and controls["S"].tolist() == [[1.0], [0.0]]
    assert controls["E"].tolist() == [[0.0], [1.0]]
    assert controls["R"].tolist() == [[1.0], [1.0]]
    assert controls["C"].dtype == torch.uint64 and controls["C"].to(torch.int64).tolist() == [[5], [9]]
    text = SequenceBatching(corrid="C", corrid_datatype="BYTES").controls([SequenceFlags("ab")])
    assert text["C"].tolist() == [[b"ab"]]


def test_a_string_id_where_corrid_is_an_integer_is_named() -> None:
    spec = SequenceBatching(corrid="CORRID")
    assert "string" in spec.accepts_id(SequenceFlags("x"))
    assert spec.accepts_id(SequenceFlags(3)) is None
    assert SequenceBatching(start="START").accepts_id(SequenceFlags("x")) is None  # no CORRID


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"control_datatype": "INT8"}, "control_datatype"),
    ({"corrid_datatype": "FP32"}, "corrid_datatype"),
    ({"idle_timeout_s": 0.5}, "idle_timeout_s"),
    ({"start": "X", "end": "X"}, "twice"),
])
def test_a_bad_declaration_fails_when_made(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SequenceBatching(**kwargs)


def test_the_config_is_tritons_sequence_batching() -> None:
    config = Accumulator.sequence_batching.config()
    assert "oldest" in config and config["max_sequence_idle_microseconds"] == 2_000_000
    kinds = {c["name"]: c["control"][0]["kind"] for c in config["control_input"]}
    assert kinds == {"START": "CONTROL_SEQUENCE_START", "END": "CONTROL_SEQUENCE_END",
                     "READY": "CONTROL_SEQUENCE_READY", "CORRID": "CONTROL_SEQUENCE_CORRID"}
    assert config["state"] == [{"input_name": "ACC", "output_name": "ACC_OUT",
                                "data_type": "TYPE_INT64", "dims": [1]}]
    assert Accumulator().metadata(Accumulator.options)["sequence_batching"] == config


# -- the book --------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def item(request_id: str) -> WorkItem:
    return WorkItem(request=decode_request(request_id, {"model": "m", "inputs": [
        {"name": "INPUT", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}), rows=1,
        signature=())


def book_with() -> tuple[SequenceBook, list[WorkItem], list[int | str], Clock]:
    put: list[WorkItem] = []
    released: list[int | str] = []
    clock = Clock()
    book = SequenceBook(SequenceBatching(start="START", state=SequenceState(
        "S", "S_OUT", (1,), "INT64"), idle_timeout_s=5), "m", put.append,
        on_released=released.append, clock=clock)
    return book, put, released, clock


def test_a_sequences_next_request_waits_until_the_one_before_it_is_answered() -> None:
    book, put, _, _ = book_with()
    a1, a2, b1 = item("a1"), item("a2"), item("b1")
    book.submit(a1, SequenceFlags(1, start=True))
    book.submit(a2, SequenceFlags(1))
    book.submit(b1, SequenceFlags(2, start=True))
    assert put == [a1, b1]  # one request of each sequence in the batcher: Oldest's batches
    a1.future.set_result(None)
    assert put == [a1, b1, a2]


def test_a_request_of_a_sequence_not_held_is_refused_with_tritons_words() -> None:
    book, put, _, _ = book_with()
    with pytest.raises(SequenceNotStarted, match="inference request for sequence 7 to model 'm' "
                                                 "must specify the START flag on the first "
                                                 "request of the sequence"):
        book.submit(item("x"), SequenceFlags(7))
    assert put == []


def test_end_releases_the_sequence_once_answered_and_a_later_request_is_refused() -> None:
    book, put, released, _ = book_with()
    first, last = item("1"), item("2")
    book.submit(first, SequenceFlags(3, start=True))
    book.submit(last, SequenceFlags(3, end=True))
    first.future.set_result(None)
    assert released == []
    last.future.set_result(None)
    assert released == [3] and len(book) == 0
    with pytest.raises(SequenceNotStarted):
        book.submit(item("3"), SequenceFlags(3))


def test_state_is_kept_per_sequence_zero_at_start_and_unchanged_by_a_failure() -> None:
    book, put, _, _ = book_with()
    s1 = item("s1")
    book.submit(s1, SequenceFlags(1, start=True))
    assert book.inputs_for([s1])["S"].tolist() == [[0]]
    out = book.keep([s1], {"O": torch.tensor([[4]]), "S_OUT": torch.tensor([[4]])}, lambda v: v)
    assert list(out) == ["O"]  # the state is not an answer
    s1.future.set_result(None)
    s2 = item("s2")
    book.submit(s2, SequenceFlags(1))
    assert book.inputs_for([s2])["S"].tolist() == [[4]]
    s2.future.set_exception(RuntimeError("failed"))  # no keep: the state stays
    s3 = item("s3")
    book.submit(s3, SequenceFlags(1))
    restart = item("r")
    book.submit(restart, SequenceFlags(1, start=True))
    s3.future.set_result(None)
    assert book.inputs_for([restart])["S"].tolist() == [[0]]  # a START starts from zero


def test_an_idle_sequence_is_released_after_its_timeout_a_busy_one_is_not() -> None:
    book, _, released, clock = book_with()
    idle, busy = item("i"), item("b")
    book.submit(idle, SequenceFlags(1, start=True))
    book.submit(busy, SequenceFlags(2, start=True))
    idle.future.set_result(None)
    clock.now = 4.9
    assert book.expire() == []
    clock.now = 5.1
    assert book.expire() == [1] and released == [1]  # 2 still runs
    assert book.holds(SequenceFlags(2)) and not book.holds(SequenceFlags(1))


def test_close_gives_back_what_waited() -> None:
    book, _, released, _ = book_with()
    first, second = item("1"), item("2")
    book.submit(first, SequenceFlags(1, start=True))
    book.submit(second, SequenceFlags(1))
    assert book.close() == [second] and released == [1]


def test_a_request_failed_by_the_fleet_that_ran_here_leaves_the_state_as_it_was() -> None:
    book, put, released, _ = book_with()
    s1, s2 = item("s1"), item("s2")
    book.submit(s1, SequenceFlags(1, start=True))
    book.keep([s1], {"S_OUT": torch.tensor([[4]])}, lambda v: v)
    s1.future.set_result(None)
    book.submit(s2, SequenceFlags(1))  # failed meanwhile by another worker's sweep
    book.keep([s2], {"S_OUT": torch.tensor([[9]])}, lambda v: v)
    s2.future.set_result(None)
    # When its result is left out (the store found the failure), its state is taken back
    assert book.void("s2", "lost") == "reverted"
    s3 = item("s3")
    book.submit(s3, SequenceFlags(1))
    assert book.inputs_for([s3])["S"].tolist() == [[4]]  # as s2's failure left it
    assert book.void("nobody", "lost") == "" and released == []


def test_a_failed_request_a_later_one_ran_on_loses_its_sequence() -> None:
    book, put, released, clock = book_with()
    s1, s2, s3 = item("s1"), item("s2"), item("s3")
    book.submit(s1, SequenceFlags(1, start=True))
    book.submit(s2, SequenceFlags(1))
    book.submit(s3, SequenceFlags(1))
    book.keep([s1], {"S_OUT": torch.tensor([[4]])}, lambda v: v)
    s1.future.set_result(None)  # s2 runs on s1's state: s1 can no longer be taken back
    assert book.void("s1", "its state is lost") == "lost"
    assert released == [1]
    with pytest.raises(SequenceStateLost, match="its state is lost"):
        s3.future.result(timeout=0)  # it waited: it fails, never runs on a state
    book.keep([s2], {"S_OUT": torch.tensor([[9]])}, lambda v: v)  # s2 keeps nothing now
    s2.future.set_result(None)
    with pytest.raises(SequenceStateLost, match="request s4: its state is lost"):
        book.submit(item("s4"), SequenceFlags(1))
    again = item("a")
    book.submit(again, SequenceFlags(1, start=True))  # a START begins it afresh
    assert book.inputs_for([again])["S"].tolist() == [[0]]
    again.future.set_result(None)
    clock.now = 100.0
    assert book.expire() == [1] and released == [1, 1]


# -- a stateful model's runner ---------------------------------------------------------------------

class RecordingAccumulator(Accumulator):
    """The accumulator, recording the CORRIDs of every batch."""

    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []

    def forward(self, batch: Batch) -> Batch:
        self.batches.append(list(batch["CORRID"].reshape(-1)))
        time.sleep(0.01)
        return super().forward(batch)


@contextmanager
def accumulator_runner() -> Iterator[tuple[ModelRunner, RecordingAccumulator]]:
    model = RecordingAccumulator()
    runner = ModelRunner(model, Device(DeviceSpec("cpu")),
                         ModelOptions(max_batch_size=8, max_delay_ms=20, warmup=False))
    runner.start()
    try:
        yield runner, model
    finally:
        runner.close()


def seq_request(request_id: str, value: int, sequence_id: int | str | None, start: bool = False,
                end: bool = False, rows: int = 1) -> Request:
    parameters = {} if sequence_id is None else {
        "sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
    return decode_request(request_id, {"model": "accumulator", "parameters": parameters,
                                       "inputs": [{"name": "INPUT", "shape": [rows, 1],
                                                   "datatype": "INT64", "data": [value] * rows}]})


def test_two_interleaved_sequences_accumulate_in_order_each_once_per_batch() -> None:
    with accumulator_runner() as (runner, model):
        futures: dict[str, list[Future[Any]]] = {"a": [], "b": []}
        for i in range(1, 11):  # all sent at once: the book holds them back one at a time
            futures["a"].append(runner.submit(seq_request(f"a{i}", i, 11, start=i == 1,
                                                          end=i == 10)))
            futures["b"].append(runner.submit(seq_request(f"b{i}", 100 * i, "22", start=i == 1)))
        sums = {k: [int(f.result(WAIT_S).outputs[0].value.reshape(-1)[0]) for f in fs]
                for k, fs in futures.items()}
        assert sums["a"] == [i * (i + 1) // 2 for i in range(1, 11)]
        assert sums["b"] == [100 * i * (i + 1) // 2 for i in range(1, 11)]
        assert all(len(set(b)) == len(b) for b in model.batches)  # one row of a sequence a batch
        assert any(len(b) == 2 for b in model.batches)  # and sequences share batches
        flags = futures["a"][-1].result(WAIT_S).outputs[1].value.reshape(-1).tolist()
        assert flags == [0, 1, 1, 11]  # START, END, READY, CORRID as the model got them
        assert not runner.sequences.holds(SequenceFlags(11))  # ended: released
        assert runner.sequences.holds(SequenceFlags("22"))


def test_a_stateful_models_requests_are_checked_as_tritons_sequence_batcher_checks_them() -> None:
    with accumulator_runner() as (runner, _):
        with pytest.raises(InvalidRequest, match="must specify a non-zero or non-empty "
                                                 "correlation ID"):
            runner.submit(seq_request("n", 1, None))
        with pytest.raises(InvalidRequest, match="must specify batch-size 1 due to requirements "
                                                 "of sequence batcher"):
            runner.submit(seq_request("r", 1, 5, start=True, rows=2))
        with pytest.raises(SequenceNotStarted, match="must specify the START flag"):
            runner.submit(seq_request("s", 1, 5))


def test_a_stateless_model_refuses_a_sequence_by_name() -> None:
    from asyncinfer.models.builtin import Identity

    runner = ModelRunner(Identity(), Device(DeviceSpec("cpu")), ModelOptions(warmup=False))
    with pytest.raises(InvalidRequest, match="not stateful.*'sequence_id'"):
        runner.submit(decode_request("x", {"model": "identity", "parameters": {
            "sequence_id": 4, "sequence_start": True}, "inputs": [
            {"name": "x", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}))


# -- the publish script's routing (fakeredis: Redis' Lua in-process) -------------------------------

HOLDER = "seq-a@host host 4242 99"


@pytest.fixture()
def broker() -> Iterator[fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    yield client
    client.close()


def register(client: fakeredis.FakeRedis, holder: str, lives_s: float,
             model: str = "accumulator") -> str:
    member = f"{sequence_list(queue_for(model), holder)}\t{holder}\t2"
    now = client.time()
    client.zadd(sequence_workers_key(model), {member: now[0] + now[1] / 1e6 + lives_s})
    client.sadd(SEQUENCE_MODELS_KEY, model)
    return member


def publish(client: fakeredis.FakeRedis, request_id: str, flags: SequenceFlags) -> int:
    publisher = Publisher(client, claim_ttl_s=60)
    push = publisher.prepare(queue_for("accumulator"), request_id, f"message {request_id}",
                             claim=False, sequence=flags)
    keys, args = script_arguments([push])
    return push.status(publisher._publish(keys=keys, args=args))


def test_a_start_pins_its_sequence_and_the_rest_follow_onto_the_same_list(
        broker: fakeredis.FakeRedis) -> None:
    member = register(broker, HOLDER, 30)
    other = register(broker, "seq-b@host host 4343 99", 30)
    publish(broker, "1", SequenceFlags(9, start=True))
    pin = broker.get(sequence_pin_key("accumulator", "u9")).decode()
    assert pin in (member, other)
    target = pin.split("\t")[0]
    publish(broker, "2", SequenceFlags(9))
    assert broker.lrange(target, 0, -1) == [b"message 2", b"message 1"]  # in order (RPOP side)
    assert 0 < broker.ttl(sequence_pin_key("accumulator", "u9")) <= 2  # the model's timeout
    publish(broker, "3", SequenceFlags(9, end=True))
    assert broker.get(sequence_pin_key("accumulator", "u9")) is None  # ended
    assert broker.llen(queue_for("accumulator")) == 0  # never the model's shared queue


def test_starts_take_turns_among_live_workers(broker: fakeredis.FakeRedis) -> None:
    register(broker, HOLDER, 30)
    register(broker, "seq-b@host host 4343 99", 30)
    for i in range(4):
        publish(broker, f"s{i}", SequenceFlags(i + 1, start=True))
    pins = {broker.get(sequence_pin_key("accumulator", f"u{i + 1}")) for i in range(4)}
    assert len(pins) == 2


def test_a_sequence_not_started_or_ended_is_refused_with_tritons_words(
        broker: fakeredis.FakeRedis) -> None:
    register(broker, HOLDER, 30)
    with pytest.raises(SequenceNotStarted, match="inference request for sequence 5 to model "
                                                 "'accumulator' must specify the START flag"):
        publish(broker, "1", SequenceFlags(5))
    assert broker.dbsize() == 2  # nothing pushed, nothing pinned


def test_a_sequence_whose_worker_lapsed_fails_naming_the_worker(
        broker: fakeredis.FakeRedis) -> None:
    register(broker, HOLDER, 30)
    publish(broker, "1", SequenceFlags("abc", start=True))
    register(broker, HOLDER, -1)  # its registration lapsed: the worker died or stopped
    with pytest.raises(SequenceStateLost, match=r"state of sequence abc of model 'accumulator' "
                                                r"is lost: its worker seq-a@host \(pid 4242 on "
                                                r"host host\)"):
        publish(broker, "2", SequenceFlags("abc"))
    register(broker, "seq-b@host host 4343 99", 30)
    publish(broker, "3", SequenceFlags("abc", start=True))  # a START begins afresh elsewhere
    assert b"4343" in broker.get(sequence_pin_key("accumulator", "sabc"))


def test_no_live_worker_to_start_on_is_said(broker: fakeredis.FakeRedis) -> None:
    with pytest.raises(SequenceUnavailable, match="no live worker serves the sequences"):
        publish(broker, "1", SequenceFlags(1, start=True))


def test_the_pin_shows_its_worker() -> None:
    assert worker_of_pin(f"l\t{HOLDER}\t2") == "seq-a@host (pid 4242 on host host)"


def test_two_instances_never_run_a_sequence_twice_at_once() -> None:
    """Two instances: a sequence's requests still run one after another (its state)."""
    model = RecordingAccumulator()
    runner = ModelRunner(model, Device(DeviceSpec("cpu")),
                         ModelOptions(max_batch_size=1, instances=2, warmup=False))
    runner.start()
    try:
        futures = [runner.submit(seq_request(f"r{i}", 1, 3, start=i == 0)) for i in range(8)]
        sums = [int(f.result(WAIT_S).outputs[0].value.reshape(-1)[0]) for f in futures]
    finally:
        runner.close()
    assert sums == list(range(1, 9))
