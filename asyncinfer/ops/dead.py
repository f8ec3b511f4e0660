"""``asyncinfer dead list|show|requeue|purge MODEL``: a model's dead letters.

Workers keep them (worker/dead_letters.py: the entry and how it is pushed). Here they are read,
requeued — the message back on ``infer.<model>`` with ``retries`` 0, no ``eta`` and a new delivery
tag, and its stored FAILURE removed, in one atomic step — and purged (:class:`DeadLetters`).

On a broker that is not Redis (RabbitMQ) the workers keep them on the result backend's Redis, and
a requeue takes the entry off the list (and its FAILURE) in one step, then publishes the message
through kombu to the model's queue; a message that cannot be published puts its entry back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asyncinfer.broker.scripts import script
from asyncinfer.config.settings import Settings
from asyncinfer.constants import queue_for, queue_of_list
from asyncinfer.wire.keys import RESULT_KEY_PREFIX, dead_letter_key
from asyncinfer.wire.messages import uuid4_text
from asyncinfer.worker.dead_letters import DeadLetter

__all__ = ["run_dead", "DeadLetters", "Requeued", "requeue_message"]

log = logging.getLogger(__name__)


def requeue_message(entry: DeadLetter) -> str:
    """The message that runs ``entry`` again: its envelope with ``retries`` 0, no ``eta``, not
    ``redelivered``, and a new delivery tag. ValueError when it cannot run again as it was."""
    why = entry.requeueable
    if why:
        raise ValueError(f"request {entry.request_id}: cannot be requeued: {why}")
    envelope = json.loads(json.dumps(entry.envelope))  # a copy
    headers = envelope.setdefault("headers", {})
    headers["retries"] = 0
    headers["eta"] = None
    headers.pop("redelivered", None)
    properties = envelope["properties"]
    properties["delivery_tag"] = uuid4_text()
    (properties.get("delivery_info") or {}).pop("redelivered", None)
    return json.dumps(envelope)


_REQUEUE = script("dead_requeue")
_CLAIM = script("dead_claim")


def _kombu_publisher(broker_url: str) -> Callable[[str, str], None]:
    """Publish a kombu envelope (text) to a queue of the broker ``broker_url`` names."""

    def publish(message: str, queue: str) -> None:
        from kombu import Connection

        from asyncinfer.worker.output.kombu_acks import publish_envelope

        with Connection(broker_url, connect_timeout=10) as conn, conn.Producer() as producer:
            publish_envelope(producer, json.loads(message), queue)

    return publish


@dataclass(frozen=True)
class Requeued:
    """What :meth:`DeadLetters.requeue` did."""

    requeued: list[str]
    not_found: list[str]
    refused: dict[str, str]


class DeadLetters:
    """The dead letters of one model on the broker ``client``.

    ``results_shared``: the result backend is the broker's Redis and database, so a requeue also
    deletes the request's stored FAILURE (a client asking for the result waits for the new run).
    """

    def __init__(self, client: Any, model: str, *, results_shared: bool = True,
                 publish: Callable[[str, str], None] | None = None) -> None:
        self.client = client
        self.model = model
        self.key = dead_letter_key(model)
        self.results_shared = results_shared
        #: ``publish(message, queue)``: how a requeued message goes back when the broker is not
        #: ``client``'s Redis (None: pushed on its list there, in the requeue's atomic step).
        self.publish = publish
        self._requeue = client.register_script(_REQUEUE)
        self._claim = client.register_script(_CLAIM)

    @classmethod
    def from_settings(cls, settings: Settings, model: str) -> DeadLetters:
        """The dead letters of ``model`` where the workers of ``settings`` keep them: on the
        broker's Redis, or the result backend's when the broker is not Redis."""
        from asyncinfer.broker.connections import redis_client
        from asyncinfer.broker.urls import is_redis_url

        broker = settings.resolved_broker_url()
        if is_redis_url(broker):
            client = redis_client(broker, settings, socket_connect_timeout=settings.connect_timeout_s)
            return cls(client, model, results_shared=settings.resolved_result_backend() == broker)
        results = settings.resolved_result_backend()
        client = redis_client(results, settings, socket_connect_timeout=settings.connect_timeout_s)
        return cls(client, model, results_shared=True, publish=_kombu_publisher(broker))

    @classmethod
    def of_every_shard(cls, settings: Settings, model: str) -> list[DeadLetters]:
        """The dead letters of ``model`` on each shard its requests live on: one
        :meth:`from_settings` but on a cluster URL that spreads requests (a request's dead letter
        is kept on its shard, in the step that acknowledges it)."""
        from asyncinfer.broker.connections import redis_client
        from asyncinfer.broker.urls import shard_urls

        urls = shard_urls(settings.resolved_broker_url())
        if len(urls) == 1:
            return [cls.from_settings(settings, model)]
        return [cls(redis_client(url, settings, socket_connect_timeout=settings.connect_timeout_s),
                    model) for url in urls]

    def entries(self) -> list[tuple[bytes, DeadLetter]]:
        """Every entry, newest first, with its stored text; unreadable ones are skipped (logged)."""
        out = []
        for stored in self.client.lrange(self.key, 0, -1):
            try:
                out.append((stored, DeadLetter.from_json(stored)))
            except (ValueError, TypeError) as exc:
                log.warning("%s holds an entry that is not a dead letter (%s): %.200r", self.key, exc,
                            stored)
        return out

    def find(self, request_id: str) -> DeadLetter | None:
        """The newest entry of ``request_id``, or None."""
        return next((e for _, e in self.entries() if e.request_id == request_id), None)

    def requeue(self, request_ids: Iterable[str] | None = None) -> Requeued:
        """Send entries back to the model's queue (all of them when ``request_ids`` is None)."""
        wanted = None if request_ids is None else list(dict.fromkeys(request_ids))
        newest: dict[str, tuple[bytes, DeadLetter]] = {}
        older: dict[str, list[bytes]] = {}  # a request kept twice runs once: its newest entry
        for stored, entry in self.entries():
            if wanted is None or entry.request_id in wanted:
                if entry.request_id in newest:
                    older.setdefault(entry.request_id, []).append(stored)
                else:
                    newest[entry.request_id] = (stored, entry)
        done: list[str] = []
        refused: dict[str, str] = {}
        for stored, entry in reversed(newest.values()):  # oldest first: they go back in order
            try:
                message = requeue_message(entry)
            except ValueError as exc:
                refused[entry.request_id] = str(exc)
                continue
            if self._send_back(stored, entry, message):
                done.append(entry.request_id)
                for duplicate in older.get(entry.request_id, ()):
                    self.client.lrem(self.key, 1, duplicate)
        not_found = [i for i in wanted or () if i not in newest]
        return Requeued(done, not_found, refused)

    def _send_back(self, stored: bytes, entry: DeadLetter, message: str) -> bool:
        """Take ``stored`` off the list, delete the stored FAILURE (when results live here) and
        send ``message`` to the model's queue; False when the entry was gone already."""
        result_key = [RESULT_KEY_PREFIX + entry.request_id] if self.results_shared else []
        if self.publish is None:
            keys = [self.key, self._queue_of(entry), *result_key]
            return bool(int(self._requeue(keys=keys, args=[stored, message])))
        if not int(self._claim(keys=[self.key, *result_key], args=[stored])):
            return False
        try:
            self.publish(message, queue_for(self.model))
        except Exception:
            self.client.rpush(self.key, stored)  # kept, as it was (oldest last)
            raise
        return True

    def purge(self) -> int:
        """Remove every entry; how many there were."""
        pipe = self.client.pipeline(transaction=True)
        pipe.llen(self.key)
        pipe.delete(self.key)
        count, _ = pipe.execute()
        return int(count)

    def _queue_of(self, entry: DeadLetter) -> str:
        """The list it came from when that is one of the model's, else ``infer.<model>``."""
        queue = queue_for(self.model)
        return entry.queue if queue_of_list(entry.queue) == queue else queue


class AllDeadLetters:
    """The dead letters of one model on every shard (:meth:`DeadLetters.of_every_shard`), as one."""

    def __init__(self, shards: list[DeadLetters]) -> None:
        self.shards = shards

    def entries(self) -> list[tuple[bytes, DeadLetter]]:
        """Every shard's entries, newest first."""
        every = [e for shard in self.shards for e in shard.entries()]
        return sorted(every, key=lambda e: e[1].failed_at, reverse=True) if len(self.shards) > 1 else every

    def find(self, request_id: str) -> DeadLetter | None:
        return next((e for _, e in self.entries() if e.request_id == request_id), None)

    def requeue(self, request_ids: Iterable[str] | None = None) -> Requeued:
        """Each shard's :meth:`DeadLetters.requeue`; an ID is not found when no shard has it."""
        wanted = None if request_ids is None else list(request_ids)
        done: list[str] = []
        refused: dict[str, str] = {}
        missing: set[str] | None = None
        for shard in self.shards:
            got = shard.requeue(wanted)
            done += got.requeued
            refused.update(got.refused)
            missing = set(got.not_found) if missing is None else missing & set(got.not_found)
        return Requeued(done, [i for i in dict.fromkeys(wanted or ()) if i in (missing or set())],
                        refused)

    def purge(self) -> int:
        return sum(shard.purge() for shard in self.shards)


def run_dead(args: argparse.Namespace) -> int:
    """Run one ``asyncinfer dead`` action; the exit status."""
    import redis

    if args.action == "requeue" and bool(args.request_ids) == bool(args.all):
        print("asyncinfer dead requeue: name request IDs or --all (not both)", file=sys.stderr)
        return 2
    settings = Settings.from_env(broker_url=args.broker_url).for_models([args.model])  # its route
    dead = AllDeadLetters(DeadLetters.of_every_shard(settings, args.model))
    try:
        if args.action == "list":
            for _, e in dead.entries():
                reason = " ".join(e.reason.split())
                print(f"{e.request_id}  {e.failed_at}  attempts={e.attempts}  {e.reason_type}: {reason}")
        elif args.action == "show":
            entry = dead.find(args.request_id)
            if entry is None:
                print(f"asyncinfer dead show: request {args.request_id} is not among the dead letters "
                      f"of model {args.model!r}", file=sys.stderr)
                return 1
            print(json.dumps(dataclasses.asdict(entry), indent=2))
        elif args.action == "requeue":
            done = dead.requeue(None if args.all else args.request_ids)
            print(f"requeued {len(done.requeued)}")
            for request_id in done.not_found:
                print(f"request {request_id} is not among the dead letters of model {args.model!r}",
                      file=sys.stderr)
            for why in done.refused.values():
                print(why, file=sys.stderr)
            return 1 if done.not_found or done.refused else 0
        else:
            print(f"purged {dead.purge()}")
    except redis.RedisError as exc:
        print(f"asyncinfer dead {args.action}: the broker failed ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 1
    return 0
