"""Putting requests on a Redis queue: idempotency and the queue bound, in one round trip.

One Lua script call per queue of a group (client/grouped.py sends the groups), each request's
rules run in turn, by Redis atomically:

- idempotency: a request sent with a caller-chosen ID claims ``asyncinfer:request:<id>`` (TTL: the
  result expiry; the claim holds the request's identity: its queue and a fingerprint of its
  version, inputs and parameters, wire/request_identity.py). A second submit of the same ID with
  the same identity finds the claim (or the stored result) and publishes nothing; the caller gets
  the first request's future. The same ID with another identity (another model, version, inputs
  or parameters) is refused with RequestIdReused naming what differs: its answer would be the
  first request's. Generated IDs (UUID4) cannot collide and claim nothing;
- backpressure: with a ``max_queue_size``, a queue already holding that many requests takes no
  more; a request waits up to its ``timeout_s`` for room (its group puts it back, with those
  behind it), then ends with QueueFull. Nothing is dropped: a request is either on the queue or
  refused. A priority level's own ``max_queue_size`` (``priority_queue_policy``,
  config/priority_policy.py) bounds its list the same way (its pushes go in calls of their own);
- the trace: with ``mark_ttl_s`` (``ASYNCINFER_LOST_AFTER_S`` > 0), a generated ID gets a field
  of the traces hash (``asyncinfer:traces``: ID → queue), written in the same script as the push
  (trace_push.lua when nothing else is checked: one LPUSH and one HSET for a group). Redis keeps a
  script's writes together (its append-only file and its replicas get them as one MULTI), so
  after a crash or a failover the trace is there exactly when the message was kept: the client's
  lost check (lost_check.py) reads "no trace and no result" as "the broker lost this request".
  The store script removes a request's trace when it stores its result (any state): a request
  costs one key (its result), not two, for the results' lifetime.

- the response cache: a request of a model with ``response_cache`` carries its cache key; found,
  the cached answer is stored under the request's ID and announced as a worker would, the model's
  hit count goes up, and nothing is pushed (CACHED); not found, its miss count goes up and the
  rules above go on. A hit or a miss costs no round trip of its own (broker/response_cache.py).
  The entry looked for is the one the weights answering such a request now computed: the script
  reads their token from the key's generation first (wire/cache_key.py).

- sequences (a stateful model's requests, v2 parameter ``sequence_id``: Triton's sequence
  batcher): a sequence's first request (``sequence_start``) is pushed onto the own list of one
  live worker serving the model's sequences (the one holding the fewest requests there, taking
  turns among equals; ``asyncinfer:sequence:workers:<model>``, worker/requests/sequence_pins.py),
  and the sequence is pinned to it (``asyncinfer:sequence:pin:<model>:<id>``, TTL the model's
  sequence timeout, renewed by each push of the sequence; an END removes it). Every later request
  goes onto that worker's list, in the order they are published — or is refused: without a pin
  (never started, ended, or idle past the timeout) with SequenceNotStarted (Triton's words);
  when the pinned worker's registration lapsed (it died, stopped, or no longer serves the model)
  with SequenceStateLost, naming it — never run on a fresh state elsewhere. A START whose pinned
  worker is gone starts afresh on a live one. Queue bounds and the response cache do not apply.

Idle workers wake without popping (workers/wake.py), so the push is all a producer does. With
nothing to check or mark (a generated ID, no ``max_queue_size``, the lost check off), it is a
plain LPUSH.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from asyncinfer.broker.scripts import script
from asyncinfer.constants import level_of, model_from_queue, priority_list, priority_lists
from asyncinfer.errors import (
    QueueFull,
    RequestIdReused,
    SequenceNotStarted,
    SequenceStateLost,
    SequenceUnavailable,
)
from asyncinfer.wire.cache_key import generation_key
from asyncinfer.wire.keys import (
    CLAIM_PREFIX,
    TRACES_KEY,
    response_cache_stats_key,
    sequence_pin_key,
    sequence_workers_key,
)
from asyncinfer.wire.request_identity import reused_message
from asyncinfer.wire.sequence import SequenceFlags, not_started_message

__all__ = ["Publisher", "PUBLISHED", "DUPLICATE", "CACHED", "script_arguments",
           "trace_push_arguments", "TRACE_PUSH", "worker_of_pin"]

PUBLISHED, DUPLICATE, FULL, CONFLICT, CACHED, LEVEL_FULL, REUSED = 1, 0, -1, -2, 2, -3, -4
#: A sequence's request refused: not started, no live worker to start it on, its state lost.
NOT_STARTED, NO_SEQUENCE_WORKER, STATE_LOST = -5, -6, -7
#: The fields of a sequence's pin (a registry member): its worker's list, holder, timeout.
_PIN_FIELDS = 3

_PUBLISH = script("publish")
#: Pushes that need nothing but their trace (_Push.trace_only): one small script per list.
TRACE_PUSH = script("trace_push")


class Publisher:
    """Publishes task messages on the Redis broker ``client``."""

    #: Between two looks at a full queue (seconds): from the first to the last.
    poll_s = (0.002, 0.05)

    def __init__(self, client: Any, *, claim_ttl_s: float, replicas: int = 0,
                 replicas_timeout_s: float = 1.0, mark_ttl_s: float = 0.0) -> None:
        self.client = client
        #: TTL of the trace a generated ID gets (0: none; see the module documentation).
        self.mark_ttl_s = _ttl_s(mark_ttl_s)
        #: ASYNCINFER_SUBMIT_REPLICAS: a publish returns once this many replicas hold it.
        self.replicas = replicas
        self.replicas_timeout_ms = max(1, int(replicas_timeout_s * 1000))
        self.claim_ttl_s = max(1, int(claim_ttl_s)) if claim_ttl_s else 0
        self._publish = client.register_script(_PUBLISH)
        self._trace_push = client.register_script(TRACE_PUSH)

    def prepare(self, queue: str, request_id: str, message: str, *, claim: bool,
                result_key: str | None = None, max_queue_size: int = 0, timeout_s: float = 0.0,
                priority: int = 0, cache_key: str = "", reply_to: str = "",
                level_max_queue_size: int = 0, identity: str = "",
                sequence: SequenceFlags | None = None, model: str | None = None) -> _Push:
        """A request to put on ``queue``, not yet sent: what a group (grouped.py) takes. With
        ``claim``, a second request of the same ID is a duplicate (or one whose result is stored
        under ``result_key``); ``max_queue_size`` bounds the queue (all its priority lists), with
        ``timeout_s`` to wait for room; ``priority`` (0-9) picks the list as kombu's Redis
        transport does. ``cache_key``: the request's response cache entry (broker/response_cache.py;
        '' for none): found, the cached answer is stored under ``result_key`` and announced there
        and on ``reply_to``, and nothing is pushed (CACHED). ``level_max_queue_size``: the bound
        of the priority level's own list (0: none). ``identity``: what the claimed ID stands for
        (wire/request_identity.py; "" for the queue alone). ``sequence``: the sequence the
        request belongs to (a stateful model's; the module's text says how it is routed).
        ``model``: the model served on ``queue`` (None: read from the queue's name)."""
        return _Push(self, queue, request_id, message, claim, result_key, max_queue_size,
                     timeout_s, priority, cache_key, reply_to, level_max_queue_size, identity,
                     sequence, model)


def script_arguments(pushes: Sequence[_Push]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the publish script for ``pushes``, in order, all onto one queue with one
    ``max_queue_size``."""
    first = pushes[0]
    lists = priority_lists([first.queue])
    keys: list[str] = list(lists)
    args: list[Any] = [len(lists), first.max_queue_size, first.queue]
    for push in pushes:
        keys += [push.list_key, push.claim_key, push.result_key, push.cache_key,
                 push.cache_stats_key, push.pin_key, push.workers_key, push.cache_generation_key]
        args += [push.message, push.claim_ttl_s, push.request_id if push.mark_ttl_s else "",
                 push.quoted_id, push.reply_to,
                 push.result_ttl_s, push.level_max_queue_size, push.identity,
                 push.sequence_mode, int(push.sequence is not None and push.sequence.end)]
    keys.append(TRACES_KEY)
    return keys, args


def trace_push_arguments(pushes: Sequence[_Push]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of trace_push.lua for ``pushes`` (each :attr:`_Push.trace_only`, all onto
    one list), in order."""
    first = pushes[0]
    args: list[Any] = [first.queue]
    for push in pushes:
        args += (push.request_id, push.message)
    return [first.list_key, TRACES_KEY], args


def worker_of_pin(pin: str) -> str:
    """The worker a pin names, as messages show it: ``node (pid P on host H)`` (its holder,
    broker/leases.py: ``node host pid start``)."""
    fields = pin.split("\t")
    holder = fields[1] if len(fields) == _PIN_FIELDS else pin
    parts = holder.rsplit(" ", 3)
    if len(parts) != 4:
        return holder
    return f"{parts[0]} (pid {parts[2]} on host {parts[1]})"


def _ttl_s(seconds: float) -> int:
    """A key's TTL in whole seconds (EX takes integers); 0 stays 0 (none)."""
    return max(1, int(seconds)) if seconds else 0


class _Push:
    """One publish's keys, arguments and the reading of the script's reply, shared by the
    publisher and the grouped ones (grouped.py, loop_publisher.py). ``publisher``: where its TTLs
    come from (``claim_ttl_s``, ``mark_ttl_s``)."""

    def __init__(self, publisher: Any, queue: str, request_id: str,
                 message: str, claim: bool, result_key: str | None, max_queue_size: int,
                 timeout_s: float, priority: int, cache_key: str = "", reply_to: str = "",
                 level_max_queue_size: int = 0, identity: str = "",
                 sequence: SequenceFlags | None = None, model: str | None = None) -> None:
        self.queue, self.request_id, self.message = queue, request_id, message
        #: The model the queue serves (its name when it is no inference queue).
        self.model = model = model or model_from_queue(queue) or queue
        self.max_queue_size = max(0, int(max_queue_size))
        self.timeout_s = timeout_s
        self.list_key = priority_list(queue, priority)
        self.level = level_of(priority)
        self.level_max_queue_size = max(0, int(level_max_queue_size))
        #: The pushes one script call takes, in order: a queue's with one bound (and, with a bound
        #: of its level, that level's only: a call stops at the first push refused for room).
        self.group_key = (queue, self.max_queue_size,
                          self.list_key if self.level_max_queue_size else "")
        self.claim_key = CLAIM_PREFIX + request_id
        #: The claim's value: what the ID stands for (the queue alone when not given).
        self.identity = identity or queue
        self.result_key = result_key or self.claim_key
        self.claim_ttl_s = publisher.claim_ttl_s if claim else 0
        self.mark_ttl_s = publisher.mark_ttl_s
        #: The response cache: the entry to look for, the model's counts, the answer's TTL.
        self.cache_key = cache_key if result_key else ""  # the answer needs the result key
        self.cache_stats_key = response_cache_stats_key(model) if self.cache_key else ""
        self.quoted_id = json.dumps(request_id) if self.cache_key else ""
        self.reply_to = reply_to if self.cache_key else ""
        self.result_ttl_s = publisher.claim_ttl_s if self.cache_key else 0
        #: The token of the weights answering the request now is read there (wire/cache_key.py).
        self.cache_generation_key = generation_key(self.cache_key) if self.cache_key else ""
        #: A sequence's request: routed to its pinned worker by the script (no cache, no bound).
        self.sequence = sequence
        self.pin_key = sequence_pin_key(model, sequence.key) if sequence else ""
        self.workers_key = sequence_workers_key(model) if sequence else ""
        self.sequence_mode = 0 if sequence is None else 1 if sequence.start else 2
        if sequence is not None:  # its own script calls: never behind a push waiting for room
            self.cache_key = self.cache_stats_key = self.quoted_id = self.reply_to = ""
            self.cache_generation_key = ""
            self.result_ttl_s = self.max_queue_size = self.level_max_queue_size = 0
            self.group_key = (queue, 0, "sequence")
        self.scripted = (claim or self.max_queue_size > 0 or publisher.mark_ttl_s > 0
                         or bool(self.cache_key) or self.level_max_queue_size > 0
                         or sequence is not None)
        #: Nothing to check, only the trace to write with the push (trace_push.lua, not the
        #: publish script's rules for each request).
        self.trace_only = (self.scripted and not claim and publisher.mark_ttl_s > 0
                           and not self.cache_key and not self.max_queue_size
                           and not self.level_max_queue_size and sequence is None)
        self.deadline = time.monotonic() + max(0.0, timeout_s)
        self._pause_s = Publisher.poll_s[0]

    def status(self, reply: Any) -> int | None:
        """PUBLISHED or DUPLICATE; None to look again after :meth:`pause_s` (the queue is full
        and the deadline not reached). Raises RequestIdReused for an ID sent before with another
        identity (another queue, version, inputs or parameters), QueueFull past the deadline."""
        status = int(reply[0])
        if status >= 0:
            return status
        if status in (CONFLICT, REUSED):
            stored = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            raise RequestIdReused(reused_message(self.request_id, self.identity, stored))
        if status in (NOT_STARTED, NO_SEQUENCE_WORKER, STATE_LOST):
            raise self._sequence_refusal(status, reply[1])
        if time.monotonic() >= self.deadline:
            depth = int(reply[1])
            if status == LEVEL_FULL:
                raise QueueFull(f"request {self.request_id}: priority level {self.level} of queue "
                                f"{self.queue} holds {depth} requests, at its bound "
                                f"(priority_queue_policy max_queue_size "
                                f"{self.level_max_queue_size}); not accepted"
                                + (f" after waiting {self.timeout_s:g} s" if self.timeout_s > 0
                                   else ""))
            raise QueueFull(f"request {self.request_id}: queue {self.queue} holds {depth} requests, "
                            f"at its bound (max_queue_size {self.max_queue_size}); not accepted"
                            + (f" after waiting {self.timeout_s:g} s" if self.timeout_s > 0 else ""))
        return None

    def _sequence_refusal(self, status: int, detail: Any) -> Exception:
        """Why the script refused this sequence's request (``status``; ``detail``: the pin)."""
        assert self.sequence is not None
        who, shown = f"request {self.request_id}", self.sequence.shown
        if status == NOT_STARTED:
            return SequenceNotStarted(
                f"{who}: {not_started_message(self.sequence, self.model)} (no live sequence "
                f"{shown}: never started, ended, or idle past the model's sequence timeout)")
        if status == NO_SEQUENCE_WORKER:
            return SequenceUnavailable(
                f"{who}: no live worker serves the sequences of model '{self.model}' (it is not "
                f"stateful, or no worker hosting it runs): sequence {shown} cannot start")
        pin = detail.decode() if isinstance(detail, bytes) else str(detail)
        return SequenceStateLost(
            f"{who}: the state of sequence {shown} of model '{self.model}' is lost: its worker "
            f"{worker_of_pin(pin)} stopped serving it (it died, stopped, or unloaded the model); "
            f"start the sequence again (sequence_start)")

    def pause_s(self) -> float:
        """How long to wait before looking again (doubling, never past the deadline)."""
        pause_s = min(self._pause_s, max(0.0, self.deadline - time.monotonic()))
        self._pause_s = min(self._pause_s * 2, Publisher.poll_s[1])
        return pause_s
