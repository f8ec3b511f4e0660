"""A worker whose renewal finds its sequence registration lapsed (frozen or cut off past its
lease) does not register again at once: only once a renewal period passed and its sequence book
holds nothing in flight, so what it ran of the requests failed meanwhile is stored (left out) and
their state taken back before a new request of its sequences can reach it (fakeredis)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.sequences import SequenceBook
from asyncinfer.models.sequence import SequenceBatching
from asyncinfer.wire.keys import sequence_workers_key
from asyncinfer.wire.protocol import decode_request
from asyncinfer.wire.sequence import SequenceFlags
from asyncinfer.worker.requests.sequence_pins import SequencePins

MODEL = "accumulator"


@pytest.fixture()
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    client.close()


def pins_with(r: fakeredis.FakeRedis) -> tuple[SequencePins, SequenceBook]:
    book = SequenceBook(SequenceBatching(start="START"), MODEL, lambda item: None)
    runner = SimpleNamespace(model=SimpleNamespace(name=MODEL), sequences=book)
    runtime: Any = SimpleNamespace(runners=lambda: [runner])
    taker: Any = None  # no sweep here
    pins = SequencePins(r, runtime, holder="w1 host 42 1", lease_s=3.0, taker=taker,
                        lease=None, refuse=lambda taken, error_of: None)
    pins.lists_for([f"infer.{MODEL}"])
    return pins, book


def until(r: fakeredis.FakeRedis) -> float:
    """The registration's score; -1 when there is none."""
    scores: Any = r.zrange(sequence_workers_key(MODEL), 0, -1, withscores=True)
    return float(scores[0][1]) if scores else -1.0


def test_a_lapsed_registration_is_renewed_only_once_nothing_of_its_sequences_is_in_flight(
        r: fakeredis.FakeRedis) -> None:
    pins, book = pins_with(r)
    pins.renew()
    member = pins.members[MODEL]
    assert until(r) > 0
    # When its registration lapsed while it was frozen (another worker sees it gone)
    r.zadd(sequence_workers_key(MODEL), {member: 1.0})
    running = WorkItem(request=decode_request("held", {"model": MODEL, "inputs": [
        {"name": "INPUT", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}), rows=1,
                       signature=())
    book.submit(running, SequenceFlags(1, start=True))
    # Then its renewal does not register it again
    pins.renew()
    assert until(r) == 1.0
    # nor while its book still runs a request, even a renewal period later
    pins._rejoin[MODEL] = 0.0
    pins.renew()
    assert until(r) == 1.0
    # and once that request is answered, it registers again
    running.future.set_result(None)
    pins.renew()
    assert until(r) > 1.0
    pins.renew()  # and is renewed as before
    assert until(r) > 1.0 and MODEL not in pins._rejoin


def test_a_registration_removed_altogether_counts_as_lapsed(r: fakeredis.FakeRedis) -> None:
    pins, _ = pins_with(r)
    pins.renew()
    r.delete(sequence_workers_key(MODEL))
    pins.renew()
    assert until(r) == -1.0 and MODEL in pins._rejoin


def test_a_clean_lapse_and_a_first_registration_are_not_lapses(r: fakeredis.FakeRedis) -> None:
    pins, _ = pins_with(r)
    pins.renew()  # the first one registers
    assert until(r) > 0 and not pins._rejoin
    pins.stop()  # a clean stop lapses it at once (score 0)
    assert until(r) == 0.0
