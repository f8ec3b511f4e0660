"""The reader of a request's stream (client/stream_reader.py) against a real Redis, on streams
written by hand as the contract (wire/stream.py) says a worker writes them: parts in order and
each once (across a reconnect, for a late reader), the final's outcomes, a trimmed stream, a bad
entry, a run interrupted (its lease gone or run out, a second start), and a request whose result
is stored with no stream at all. No worker: nothing here waits for one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states
from celery.exceptions import TaskRevokedError

from asyncinfer.client import Client
from asyncinfer.client.stream_progress import Interruption, StreamMalformed
from asyncinfer.client.stream_reader import StreamReader
from asyncinfer.errors import (
    AsyncInferError,
    ModelError,
    RequestRevoked,
    RequestTimeout,
    StreamTruncated,
)
from asyncinfer.wire.keys import LEASES_KEY
from asyncinfer.wire.stream import encode_part, part_id, stream_key

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def db(redis_db) -> Iterator[Any]:
    yield redis_db


@pytest.fixture()
def client(db) -> Iterator[Client]:
    c = Client(broker_url=db.url)
    try:
        yield c
    finally:
        c.close()


def word(n: int) -> list[dict[str, Any]]:
    return [{"name": "text_output", "datatype": "BYTES", "shape": [1, 1], "data": [f"w{n}"]}]


class Stream:
    """Writes one request's stream as a worker would."""

    def __init__(self, r: Any, request_id: str) -> None:
        self.r, self.id, self.key = r, request_id, stream_key(request_id)
        self.part, self.seq = 0, 0

    def start(self, tag: str = "", worker: str = "w@host", attempt: int = 1) -> None:
        self._marker({"kind": "start", "worker": worker, "tag": tag, "attempt": str(attempt)})

    def parts(self, *numbers: int) -> None:
        for n in numbers:
            self.r.xadd(self.key, {"kind": "part", "data": encode_part(word(n))}, id=part_id(n))
            self.part, self.seq = n, 0

    def final(self, status: str = "SUCCESS", error: str = "") -> None:
        self._marker({"kind": "final", "status": status, "error": error,
                      "parts": str(self.part)})

    def _marker(self, fields: dict[str, str]) -> None:
        self.seq += 1
        self.r.xadd(self.key, fields, id=f"{self.part}-{self.seq}")


def words(parts: list[Any]) -> list[tuple[int, str]]:
    return [(p.index, p["text_output"].reshape(-1)[0]) for p in parts]


def lease(r: Any, tag: str, *, in_s: float) -> None:
    seconds, micros = r.time()
    r.zadd(LEASES_KEY, {tag: seconds + micros / 1e6 + in_s})


def test_a_late_reader_gets_every_part_in_order_once(db, client) -> None:
    # Given a stream a worker wrote and ended: a start, three parts, a final
    s = Stream(db.client, "late-1")
    s.start("tag-1")
    s.parts(1, 2, 3)
    s.final()
    # When it is read from the start, long after
    with client.read_stream("late-1") as parts:
        got = list(parts)
        # Then every part comes once, in order, with its outputs
        assert words(got) == [(1, "w1"), (2, "w2"), (3, "w3")]
        assert all(p.request_id == "late-1" for p in got)
        assert got[0].as_numpy("text_output").shape == (1, 1)
        assert got[0].outputs["text_output"]["datatype"] == "BYTES"
        assert parts.ended and parts.interruptions == []


def test_parts_arrive_as_they_are_written(db, client) -> None:
    # Given a request that has made one part so far
    s = Stream(db.client, "live-1")
    s.start()
    s.parts(1)
    parts = client.read_stream("live-1", check_s=0.05)
    # When the reader reads it, then the worker writes the rest
    first = next(parts)
    assert not parts.ended
    s.parts(2, 3)
    second = next(parts)
    s.parts(4)
    s.final()
    rest = list(parts)
    # Then each part came once, in order
    assert words([first, second, *rest]) == [(1, "w1"), (2, "w2"), (3, "w3"), (4, "w4")]
    assert parts.ended


def test_a_reader_that_reconnects_goes_on_after_the_last_part_it_saw(db, client) -> None:
    # Given a stream of five parts, and a reader that saw three and lost its connection
    s = Stream(db.client, "resume-1")
    s.start()
    s.parts(1, 2, 3)
    first = client.read_stream("resume-1")
    seen = [next(first) for _ in range(3)]
    first.close()
    s.parts(4, 5)
    s.final()
    # When it reads again after part 3
    again = list(client.read_stream("resume-1", after=seen[-1].index))
    # Then it gets parts 4 and 5, none of the first three again
    assert words(seen) + words(again) == [(i, f"w{i}") for i in range(1, 6)]


def test_a_final_failure_raises_the_stored_error(db, client) -> None:
    # Given a stream whose request failed, with its result stored as the worker stores it
    s = Stream(db.client, "fail-1")
    s.start()
    s.parts(1)
    s.final("FAILURE", "ModelError: request fail-1: the model raised")
    client.app.backend.mark_as_failure("fail-1", ModelError("request fail-1: the model raised"))
    parts = client.read_stream("fail-1")
    # Then the part before it comes, then the stored error, as the request's future raises it
    assert words([next(parts)]) == [(1, "w1")]
    with pytest.raises(ModelError, match="request fail-1: the model raised"):
        next(parts)
    assert parts.ended


def test_a_final_failure_without_a_stored_result_raises_its_text(db, client, monkeypatch) -> None:
    monkeypatch.setattr(StreamReader, "failure_wait_s", 0.1)
    s = Stream(db.client, "fail-2")
    s.final("FAILURE", "ValueError: bad things")
    with pytest.raises(AsyncInferError, match="request fail-2: failed: ValueError: bad things"):
        list(client.read_stream("fail-2"))


def test_a_final_revoked_raises_request_revoked_naming_the_request(db, client) -> None:
    s = Stream(db.client, "revoked-1")
    s.start()
    s.parts(1, 2)
    s.final("REVOKED", "revoked")
    parts = client.read_stream("revoked-1")
    assert [p.index for p in (next(parts), next(parts))] == [1, 2]
    with pytest.raises(RequestRevoked, match="request revoked-1: revoked"):
        next(parts)


def test_a_trimmed_stream_says_which_parts_were_missed(db, client) -> None:
    # Given a stream whose first two parts were trimmed (stream_max_parts)
    s = Stream(db.client, "trim-1")
    s.parts(1, 2, 3, 4)
    db.client.xdel(s.key, "1-0", "2-0")
    s.final()
    # When a reader starts from the beginning, then Truncated names the request and the parts
    with pytest.raises(StreamTruncated, match=r"request trim-1: parts 1-2 of its stream were "
                                              r"trimmed.*holds part 3 on") as caught:
        list(client.read_stream("trim-1"))
    assert list(caught.value.missed) == [1, 2]
    # And a reader after part 1 misses part 2 alone; one after part 2 misses nothing
    with pytest.raises(StreamTruncated, match="request trim-1: part 2 of"):
        list(client.read_stream("trim-1", after=1))
    assert [p.index for p in client.read_stream("trim-1", after=2)] == [3, 4]


def test_a_gap_after_parts_shows_the_parts_before_it_first(db, client) -> None:
    s = Stream(db.client, "trim-2")
    s.parts(1, 2, 4)
    parts = client.read_stream("trim-2")
    assert [next(parts).index, next(parts).index] == [1, 2]
    with pytest.raises(StreamTruncated, match="request trim-2: part 3 of"):
        next(parts)


@pytest.mark.parametrize("fields, rule", [
    ({"kind": "bogus"}, "unknown kind 'bogus'"),
    ({"kind": "part", "data": '{"outputs": 3}'}, "a part's data must be"),
    ({"kind": "final", "status": "DONE"}, "status 'DONE'"),
])
def test_a_malformed_entry_raises_naming_the_request(db, client, fields, rule) -> None:
    s = Stream(db.client, "bad-1")
    s.parts(1)
    db.client.xadd(s.key, fields, id="1-1" if fields["kind"] != "part" else "2-0")
    parts = client.read_stream("bad-1")
    assert next(parts).index == 1
    with pytest.raises(StreamMalformed, match=f"request bad-1: its stream .* {rule}"):
        next(parts)


def test_an_interrupted_run_is_reported_once_and_no_part_comes_twice(db, client) -> None:
    # Given a request started by a worker whose lease is gone (it died), after part 2
    s = Stream(db.client, "died-1")
    s.start("tag-1", worker="first@host")
    s.parts(1, 2)
    reported: list[Interruption] = []

    def interrupted(interruption: Interruption) -> None:
        # (the reader noticed: the request runs again on another worker, which skips the
        # parts already there and goes on from part 3)
        reported.append(interruption)
        lease(db.client, "tag-2", in_s=60)
        s.start("tag-2", worker="second@host", attempt=2)
        s.parts(3, 4)
        s.final()

    with client.read_stream("died-1", check_s=0.05, on_interrupted=interrupted) as parts:
        got = list(parts)
        # Then the interruption was reported once, naming the run, and each part came once
        assert words(got) == [(i, f"w{i}") for i in range(1, 5)]
        assert parts.interruptions == reported
    assert len(reported) == 1
    assert (reported[0].request_id, reported[0].worker, reported[0].tag,
            reported[0].attempt, reported[0].after_part) == ("died-1", "first@host", "tag-1", 1, 2)
    assert "lease is gone" in reported[0].reason


def test_a_lease_run_out_is_an_interruption(db, client) -> None:
    # Given a run whose lease ran out (its worker froze) and no final
    s = Stream(db.client, "froze-1")
    lease(db.client, "tag-f", in_s=-5)
    s.start("tag-f")
    s.parts(1)

    def interrupted(interruption: Interruption) -> None:
        s.final("REVOKED", "revoked")

    parts = client.read_stream("froze-1", check_s=0.05, on_interrupted=interrupted)
    assert next(parts).index == 1
    with pytest.raises(RequestRevoked):
        next(parts)
    assert len(parts.interruptions) == 1
    assert "lease ran out" in parts.interruptions[0].reason


def test_a_second_start_is_an_interruption_when_none_was_reported(db, client) -> None:
    # Given a run that holds its lease, then a second start (the first run was lost unseen)
    s = Stream(db.client, "twice-1")
    lease(db.client, "tag-a", in_s=60)
    lease(db.client, "tag-b", in_s=60)
    s.start("tag-a")
    s.parts(1)
    s.start("tag-b", worker="other@host", attempt=2)
    s.parts(2)
    s.final()
    parts = client.read_stream("twice-1", check_s=0.05)
    assert [p.index for p in parts] == [1, 2]
    assert [(i.tag, i.after_part) for i in parts.interruptions] == [("tag-a", 1)]
    assert "a new start" in parts.interruptions[0].reason


def test_a_live_lease_is_no_interruption(db, client) -> None:
    s = Stream(db.client, "alive-1")
    lease(db.client, "tag-l", in_s=60)
    s.start("tag-l")
    with pytest.raises(RequestTimeout, match="request alive-1: its stream did not end within"):
        list(client.read_stream("alive-1", check_s=0.05, timeout_s=0.5))


def test_a_stored_result_without_a_stream_is_one_part(db, client) -> None:
    # Given a request of a model that does not stream: its result stored, no stream
    response = {"id": "plain-1", "model_name": "identity", "parameters": {},
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.5]}]}
    client.app.backend.store_result("plain-1", response, states.SUCCESS)
    # Then its stream is that result as one part
    parts = list(client.read_stream("plain-1"))
    assert [(p.index, p["y"].tolist()) for p in parts] == [(1, [[1.5, 2.5]])]


def test_a_stored_error_without_a_stream_is_raised(db, client) -> None:
    client.app.backend.mark_as_failure("plain-2", ModelError("request plain-2: no"))
    with pytest.raises(ModelError, match="request plain-2: no"):
        list(client.read_stream("plain-2"))
    client.app.backend.mark_as_revoked("plain-3", "expired")
    with pytest.raises(RequestRevoked, match="request plain-3: expired") as caught:
        list(client.read_stream("plain-3"))
    assert isinstance(caught.value.__cause__, TaskRevokedError)


def test_bad_arguments_are_refused_at_once(client) -> None:
    with pytest.raises(ValueError, match="after must be a part number"):
        client.read_stream("x", after=-1)
    with pytest.raises(ValueError, match="check_s must be above 0"):
        client.read_stream("x", check_s=0)
    with pytest.raises(ValueError, match="after must be a part number"):
        client.aread_stream("x", after=-1)
    with pytest.raises(ValueError, match="check_s must be above 0"):
        client.aread_stream("x", check_s=-1)
    with pytest.raises(ValueError, match="check_s must be above 0"):
        client.astream("echo-stream", {"text_input": ["a"]}, check_s=0)


def test_aread_stream_reads_in_order_and_reports_interruptions(db, client) -> None:
    s = Stream(db.client, "async-1")
    s.start("tag-x")
    s.parts(1)
    seen: list[Interruption] = []

    def interrupted(interruption: Interruption) -> None:
        seen.append(interruption)
        s.start("", attempt=2)
        s.parts(2, 3)
        s.final()

    async def read() -> tuple[list[Any], list[Interruption]]:
        stream = client.aread_stream("async-1", check_s=0.05, on_interrupted=interrupted)
        got = [p async for p in stream]
        again = [p async for p in client.aread_stream("async-1", after=1)]
        await client.aclose()
        return got + again, stream.interruptions

    parts, interruptions = asyncio.run(read())
    assert words(parts) == [(1, "w1"), (2, "w2"), (3, "w3"), (2, "w2"), (3, "w3")]
    assert interruptions == seen and len(seen) == 1 and seen[0].tag == "tag-x"


def test_aread_stream_raises_what_the_sync_reader_raises(db, client) -> None:
    Stream(db.client, "async-2").final("REVOKED", "revoked")
    client.app.backend.mark_as_failure("async-3", ModelError("request async-3: no"))

    async def read(request_id: str) -> list[Any]:
        return [p async for p in client.aread_stream(request_id)]

    with pytest.raises(RequestRevoked, match="request async-2"):
        asyncio.run(read("async-2"))
    with pytest.raises(ModelError, match="request async-3"):
        asyncio.run(read("async-3"))


def test_a_reader_whose_connection_is_cut_goes_on_after_the_last_part(db, client) -> None:
    # Given a reader that has read part 1
    s = Stream(db.client, "cut-1")
    s.start()
    s.parts(1)
    parts = client.read_stream("cut-1", check_s=0.05)
    assert next(parts).index == 1
    # When Redis drops the reader's connection (every other one on this database), and the
    # worker goes on
    own = db.client.client_id()
    cut = [c["id"] for c in db.client.client_list()
           if int(c["db"]) == db.number and int(c["id"]) != own]
    assert cut
    for client_id in cut:
        db.client.client_kill_filter(_id=client_id)
    s.parts(2, 3)
    s.final()
    # Then the reader goes on from part 2: none lost, none twice
    assert [p.index for p in parts] == [2, 3]


def test_aread_stream_in_threads_tells_interruptions_on_the_loop(db, client, monkeypatch) -> None:
    # (the form a Sentinel result backend reads in: the blocking reader in the loop's executor)
    from asyncinfer.client.streams import Streams

    monkeypatch.setattr(Streams, "for_running_loop", lambda self: None)
    s = Stream(db.client, "threads-1")
    s.start("tag-t")
    s.parts(1)
    threads: list[str] = []

    def interrupted(interruption: Interruption) -> None:
        import threading

        threads.append(threading.current_thread().name)
        s.start("", attempt=2)
        s.parts(2)
        s.final()

    async def read() -> tuple[list[int], str]:
        import threading

        stream = client.aread_stream("threads-1", check_s=0.05, on_interrupted=interrupted)
        return [p.index async for p in stream], threading.current_thread().name

    got, loop_thread = asyncio.run(read())
    assert got == [1, 2]
    assert threads == [loop_thread]
