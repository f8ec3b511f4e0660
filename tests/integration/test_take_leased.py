"""The leased take reads a message's fields from its text (no decode) where the text says them
plainly, and decodes it otherwise: for every message of the corpus it records, starts and counts
deaths exactly as the decoding take does; it records in the leases, not in kombu's index, with
no exchange and the queue in kombu's entry (the leases put it back). A task or an eta the text
says twice is read where it first says it (they decide only whether a STARTED state is stored,
and only ever under the message's own request ID)."""

from __future__ import annotations

import json

import pytest
import redis

from asyncinfer.broker.take import LeaseTerms, StartedText, Taker
from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.constants import priority_lists
from asyncinfer.wire.envelope import tag_in
from asyncinfer.wire.keys import LEASE_HOLDERS_KEY, LEASES_KEY, UNACKED_INDEX_KEY, UNACKED_KEY
from asyncinfer.wire.messages import task_message
from tests.support.databases import RedisDatabase

QUEUE = "infer.m"
DEATHS = "asyncinfer:deaths:"
STARTED = StartedText(b"celery-task-meta-", '{"status": "STARTED", "task_id": ', "}", 60,
                      "asyncinfer.infer")


@pytest.fixture()
def r(redis_db: RedisDatabase) -> redis.Redis:
    return redis_db.client


def _envelope(request_id: str) -> dict:
    return json.loads(task_message("asyncinfer.infer", request_id, {"model": "m", "inputs": []},
                                   QUEUE))


def _edited(request_id: str, edit) -> str:
    envelope = _envelope(request_id)
    edit(envelope)
    return json.dumps(envelope, separators=(",", ":"))


def _set(path: tuple[str, ...], value):
    def edit(envelope: dict) -> None:
        target = envelope
        for name in path[:-1]:
            target = target.setdefault(name, {})
        target[path[-1]] = value
    return edit


#: Valid envelopes, each in a form a producer may send: the fields the take acts on must come out
#: the same whether it reads them from the text or decodes the envelope.
CORPUS = {
    "ours, compact": _edited("compact", lambda e: None),
    "kombu's json.dumps (spaced)": json.dumps(_envelope("spaced")),
    "an eta": _edited("eta", _set(("headers", "eta"), "2030-01-01T00:00:00+00:00")),
    "an empty eta": _edited("eta-empty", _set(("headers", "eta"), "")),
    "redelivered, one death": _edited("again", _set(("headers", "redelivered"), True)),
    "redelivered false": _edited("not-again", _set(("headers", "redelivered"), False)),
    "another task": task_message("other.task", "other", {}, QUEUE),
    "an ID in the stamps too": _edited("stamped", _set(("headers", "stamps"), {"id": "decoy"})),
    "an ID as a value elsewhere": _edited("valued", _set(("headers", "shadow"), "id")),
    "an escape in a header": _edited("escaped", _set(("headers", "argsrepr"), 'say "hi"\\')),
    "an ID that needs escaping": _edited('odd"id', lambda e: None),
    "a key written with an escape": _edited("uni", _set(("headers", "id\u00e9"), "x")),
    "the tag in the headers too": _edited("two-tags", _set(("headers", "delivery_tag"), "decoy")),
    "no delivery info": _edited("no-info", lambda e: e["properties"].pop("delivery_info")),
    "an exchange": _edited("exchanged", _set(("properties", "delivery_info", "exchange"), "x")),
    "headers null": _edited("no-headers", _set(("headers",), None)),
    "an ID null": _edited("id-null", _set(("headers", "id"), None)),
    "an ID a number": _edited("id-number", _set(("headers", "id"), 7)),
    "a body that is not base64": _edited("plain-body", _set(
        ("body",), json.dumps([[], {"model": "m", "delivery_tag": "x", "id": "y"}, {}]))),
}


def _take(r: redis.Redis, raw: str, leased: bool) -> dict:
    """What one take of ``raw`` leaves: its flags, kombu's entry, the STARTED state."""
    r.flushdb()
    request_id = json.loads(raw).get("headers", None) or {}
    rid = request_id.get("id") if isinstance(request_id, dict) else None
    if isinstance(rid, str):
        r.set(DEATHS + rid, 1)
    r.lpush(QUEUE, raw)
    lease = LeaseTerms(10.0 if leased else 0.0, "w1", DEATHS)  # 0: the decoding take
    [(_, popped, recorded, started, deaths)] = Taker(r).take(priority_lists([QUEUE]), 5, STARTED,
                                                             lease=lease)
    assert popped == raw.encode()
    tag = json.loads(raw)["properties"]["delivery_tag"]
    entry = r.hget(UNACKED_KEY, tag)
    states = {k: r.get(k) for k in r.scan_iter(match="celery-task-meta-*")}
    return {"recorded": recorded, "started": started, "deaths": deaths,
            "entry": json.loads(entry) if entry else None, "states": states,
            "leased": r.zscore(LEASES_KEY, tag) is not None,
            "indexed": r.zscore(UNACKED_INDEX_KEY, tag) is not None}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_leased_take_acts_on_a_message_as_the_decoding_take(r, name) -> None:
    raw = CORPUS[name]
    leased, decoding = _take(r, raw, True), _take(r, raw, False)
    assert leased["recorded"] and decoding["recorded"], name
    for field in ("started", "deaths", "states"):
        assert leased[field] == decoding[field], (name, field)
    # kombu's entry: the message byte for byte; a leased one names no exchange, and its queue
    assert leased["entry"][0] == decoding["entry"][0], name
    assert leased["entry"][1:] == ["", QUEUE], name
    assert (leased["leased"], leased["indexed"]) == (True, False)
    assert (decoding["leased"], decoding["indexed"]) == (False, True)


def test_the_corpus_exercises_what_the_take_acts_on(r) -> None:
    """The corpus is not all alike: some start, some do not, one counts a death."""
    results = {name: _take(r, raw, True) for name, raw in CORPUS.items()}
    assert results["ours, compact"]["started"] and results["kombu's json.dumps (spaced)"]["started"]
    assert not results["an eta"]["started"] and results["an empty eta"]["started"]
    assert results["redelivered, one death"]["deaths"] == 1
    assert results["redelivered false"]["deaths"] == 0 and results["redelivered false"]["started"]
    assert not results["another task"]["started"] and not results["an ID null"]["started"]
    assert _take(r, CORPUS["an exchange"], False)["entry"][1] == "x"
    assert results["an exchange"]["entry"][1:] == ["", QUEUE]
    assert results["no delivery info"]["entry"][1:] == ["", QUEUE]
    assert results["an ID that needs escaping"]["states"] == {
        b'celery-task-meta-odd"id': b'{"status": "STARTED", "task_id": "odd\\"id"}'}


def test_a_task_or_eta_said_twice_is_read_where_the_text_first_says_it(r) -> None:
    # Given a delayed request whose headers first say a decoy eta (null) and task, nested
    envelope = _envelope("twice")
    envelope["headers"] = {"stamps": {"eta": None, "task": "asyncinfer.infer"},
                           **{k: v for k, v in envelope["headers"].items() if k != "stamps"},
                           "eta": "2030-01-01T00:00:00+00:00"}
    raw = json.dumps(envelope, separators=(",", ":"))
    assert raw.index('"eta":null') < raw.index('"eta":"2030')
    leased, decoding = _take(r, raw, True), _take(r, raw, False)
    # Then the decoding take stores no STARTED state (delayed); the leased one reads the first
    # eta and stores one, under the request's own ID only
    assert not decoding["started"] and decoding["states"] == {}
    assert leased["started"] and list(leased["states"]) == [b"celery-task-meta-twice"]
    # and a request ID said twice (a decoy first) is decoded, never read from the text
    envelope["headers"]["eta"] = None
    envelope["headers"]["stamps"] = {"id": "decoy"}
    raw = json.dumps(envelope, separators=(",", ":"))
    assert raw.index('"id":"decoy"') < raw.index('"id":"twice"')
    leased, decoding = _take(r, raw, True), _take(r, raw, False)
    assert list(leased["states"]) == list(decoding["states"]) == [b"celery-task-meta-twice"]


MALFORMED = {
    "headers a list": '{"body": "e30=", "headers": [1, 2], "properties": {"delivery_tag": "t-list"}}',
    "not JSON": '{"body": "e30=", "properties": {"delivery_tag": "t-trunc"',
    "nested 10,000 deep": ('{"body": "e30=", "headers": {"x": ' + "[" * 10_000 + "]" * 10_000
                           + '}, "properties": {"delivery_tag": "t-deep"}}'),
}


def test_a_leased_take_records_what_the_consumer_must_answer(r) -> None:
    """A leased take records a message whose text names its tag plainly, even when it is no
    valid envelope: the consumer decodes it, answers it as malformed and acknowledges it under
    the tag its text names (tag_in). kombu's sweep never meets it (it is not in the index)."""
    for raw in MALFORMED.values():
        r.lpush(QUEUE, raw)
    taken = Taker(r).take(priority_lists([QUEUE]), 10, STARTED, lease=LeaseTerms(10.0, "w1"))
    assert [recorded for _, _, recorded, _, _ in taken] == [True, True, True]
    tags = {tag_in(raw) for _, raw, _, _, _ in taken}
    assert tags == {"t-list", "t-trunc", "t-deep"}
    assert {t.decode() for t in r.hkeys(UNACKED_KEY)} == tags == {
        t.decode() for t in r.hkeys(LEASE_HOLDERS_KEY)}
    assert r.zcard(UNACKED_INDEX_KEY) == 0
    app = create_app(Settings(broker_url=f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}"
                                         f"/{r.connection_pool.connection_kwargs.get('db', 0)}",
                              visibility_timeout_s=0.0))
    with app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=100)
    assert r.llen(QUEUE) == 0 and r.hlen(UNACKED_KEY) == 3
