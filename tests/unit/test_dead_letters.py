"""Dead letters (``asyncinfer:dead:<model>``) in process, on fakeredis: the entry format, its
bounds, which outcomes make one. Real workers keeping them, and requeue and purge through the real
``asyncinfer dead`` command: tests/integration/test_dead_letters.py."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import fakeredis
import pytest
from celery import states

from asyncinfer.config.bound import bind
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.config.settings import Settings
from asyncinfer.constants import PRIORITY_SEP
from asyncinfer.errors import InvalidRequest, ModelError
from asyncinfer.ops.dead import requeue_message
from asyncinfer.wire.envelope import parse_envelope
from asyncinfer.wire.keys import dead_letter_key
from asyncinfer.wire.messages import task_message
from asyncinfer.worker.dead_letters import (
    DeadLetter,
    entry_for,
    options_of,
    push,
)
from asyncinfer.worker.output.outcome import Outcome, add_dead_letter
from asyncinfer.worker.requests.taken import TakenMessage

pytestmark = pytest.mark.timeout(180)

OPTIONS = json.dumps({"poison": {"dead_letter": True},
                      "sleep": {"dead_letter": True, "dead_letter_max_entries": 3,
                                "dead_letter_ttl_s": 120},
                      "flaky": {"dead_letter": True}})


# -- in-process: the entry, its bounds, which outcomes make one ----------------------------------

def _delivery(model: str = "poison", retries: int = 0, key: str = "") -> TakenMessage:
    request_id = str(uuid.uuid4())
    raw = task_message("asyncinfer.infer", request_id, {"model": model, "inputs": []}, f"infer.{model}")
    envelope = json.loads(raw)
    envelope["headers"]["retries"] = retries
    envelope["headers"]["eta"] = "2020-01-01T00:00:00+00:00"
    envelope["headers"]["redelivered"] = True
    d = TakenMessage(raw=json.dumps(envelope).encode(), queue=f"infer.{model}", received_at=time.time(),
                 key=key)
    parse_envelope(d)
    return d


class _App:
    """Enough of an app for the dead-letter functions: its settings, bound as asyncinfer binds them."""


def _app(options: str = OPTIONS) -> Any:
    app = _App()
    bind(app, Settings(model_options=options))
    return app


def test_an_entry_holds_the_envelope_reason_attempts_worker_and_time() -> None:
    d = _delivery(retries=2, key=f"infer.poison{PRIORITY_SEP}3")
    before = datetime.now(timezone.utc)
    entry = entry_for(d.request_id, d.list_key, ModelError(f"request {d.request_id}: boom"), raw=d.raw,
                      retries=2, worker="w@h")
    assert (entry.request_id, entry.model, entry.queue) == (d.request_id, "poison", d.list_key)
    assert (entry.reason_type, entry.reason) == ("ModelError", f"request {d.request_id}: boom")
    assert (entry.attempts, entry.worker, entry.raw) == (3, "w@h", "")
    assert entry.envelope == json.loads(d.raw)
    assert before <= datetime.fromisoformat(entry.failed_at) <= datetime.now(timezone.utc)
    assert DeadLetter.from_json(entry.to_json()) == entry and entry.requeueable == ""


def test_requeue_message_resets_retries_eta_redelivery_and_the_tag() -> None:
    d = _delivery(retries=3)
    entry = entry_for(d.request_id, d.queue, RuntimeError("x"), raw=d.raw, retries=3, worker="w")
    again = json.loads(requeue_message(entry))
    original = json.loads(d.raw)
    assert again["headers"]["retries"] == 0 and again["headers"]["eta"] is None
    assert "redelivered" not in again["headers"]
    assert again["properties"]["delivery_tag"] != original["properties"]["delivery_tag"]
    assert again["body"] == original["body"] and again["headers"]["id"] == d.request_id
    assert entry.envelope == original  # the entry itself is left as it was


def test_malformed_and_refused_messages_are_kept_but_cannot_be_requeued() -> None:
    malformed = entry_for("r1", "infer.poison", InvalidRequest("request r1: malformed"),
                          raw=b'{"id": "r1", not json' + b"x" * 10000, retries=0, worker="w")
    assert malformed.envelope is None and malformed.raw.startswith('{"id": "r1"')
    assert len(malformed.raw) == 4096
    with pytest.raises(ValueError, match="request r1: cannot be requeued: its message was not a kombu"):
        requeue_message(malformed)
    pickled = json.loads(task_message("asyncinfer.infer", "r2", {}, "infer.poison"))
    pickled["content-type"] = "application/x-python-serialize"
    refused = entry_for("r2", "infer.poison", InvalidRequest("pickle"), raw=json.dumps(pickled),
                        retries=0, worker="w")
    assert refused.envelope is not None and refused.envelope["body"] is None  # never kept
    with pytest.raises(ValueError, match="content type 'application/x-python-serialize' is refused"):
        requeue_message(refused)


def test_push_keeps_the_newest_entries_up_to_the_bound_and_sets_the_ttl() -> None:
    r = fakeredis.FakeRedis()
    options = ModelOptions(dead_letter=True, dead_letter_max_entries=3, dead_letter_ttl_s=50)
    ids = []
    for _ in range(5):
        d = _delivery()
        ids.append(d.request_id)
        push(r, entry_for(d.request_id, d.queue, RuntimeError("x"), raw=d.raw, retries=0, worker="w"),
             options)
    stored = [DeadLetter.from_json(s).request_id for s in r.lrange(dead_letter_key("poison"), 0, -1)]
    assert stored == ids[:1:-1]  # newest first, the two oldest trimmed away
    assert 0 < r.ttl(dead_letter_key("poison")) <= 50
    push(r, entry_for("r", "infer.poison", RuntimeError("x"), raw="{}", retries=0, worker="w"),
         ModelOptions(dead_letter=True, dead_letter_ttl_s=0))
    assert r.ttl(dead_letter_key("poison")) == -1 and r.llen(dead_letter_key("poison")) == 4


@pytest.mark.parametrize(("state", "retry", "store", "model", "kept"), [
    (states.FAILURE, None, True, "poison", True),
    (states.FAILURE, None, True, "affine", False),  # not opted in
    (states.FAILURE, None, False, "poison", False),  # a duplicate, acknowledged only
    (states.RETRY, "{}", True, "poison", False),  # not final
    (states.SUCCESS, None, True, "poison", False),
    (states.REVOKED, None, True, "poison", False),
])
def test_add_dead_letter_keeps_only_final_failures_of_models_that_opted_in(
        state: str, retry: str | None, store: bool, model: str, kept: bool) -> None:
    r = fakeredis.FakeRedis()
    d = _delivery(model, retries=1)
    pipe = r.pipeline(transaction=True)
    add_dead_letter(pipe, _app(), Outcome(d, state, ModelError("m"), retry=retry, store=store),
                    "unit@host")
    pipe.execute()
    stored = r.lrange(dead_letter_key(model), 0, -1)
    assert len(stored) == (1 if kept else 0)
    if kept:
        entry = DeadLetter.from_json(stored[0])
        assert (entry.request_id, entry.attempts, entry.worker) == (d.request_id, 2, "unit@host")


def test_add_dead_letter_never_raises() -> None:
    class Broken:
        def lpush(self, *_: Any) -> None:
            raise RuntimeError("broken pipe object")

    add_dead_letter(Broken(), _app(), Outcome(_delivery(), states.FAILURE, ModelError("m")),
                    "unit@host")  # logged only


def test_options_validate_and_star_opts_every_model_in() -> None:
    assert options_of(_app('{"*": {"dead_letter": true}}'), "anything").dead_letter is True
    assert options_of(_app("{}"), "poison") == ModelOptions()
    defaults = ModelOptions()
    assert (defaults.dead_letter, defaults.dead_letter_ttl_s, defaults.dead_letter_max_entries) == \
        (False, 7 * 24 * 3600, 10000)
    for bad, message in (({"dead_letter": "yes"}, "dead_letter must be true or false"),
                         ({"dead_letter_max_entries": 0}, "dead_letter_max_entries must be an integer >= 1"),
                         ({"dead_letter_ttl_s": -1}, "dead_letter_ttl_s must be a finite number >= 0")):
        with pytest.raises(ValueError, match=message):
            ModelOptions().merged(bad)
