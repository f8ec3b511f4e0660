"""The worker's side of the response cache (broker/response_cache.py): which requests fill it, and the
write of their answers, in the round trip that stores the results.

Only a successful answer is written (the result writer calls :meth:`CacheWrites.add` for state
SUCCESS alone): a failure, a retry, a revocation, an answer that could not be encoded, or a
request whose own row of a batch failed never reaches the cache. The worker does not read the
cache: the look-up happens at submit, in the publish script, where a hit saves the queue too.
An answer is written under the token of the weights that computed it, and kept only while they
answer its requests (worker/cache_generations.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, states

from asyncinfer.broker import response_cache
from asyncinfer.broker.keyspace import keyspace
from asyncinfer.broker.store import Entry, StoreScript, as_out_of_memory, store_reply
from asyncinfer.constants import TASK_NAME
from asyncinfer.wire.cache_key import cache_key, entry_key, generation_name
from asyncinfer.wire.envelope import result_meta
from asyncinfer.wire.result_json import encode_meta
from asyncinfer.worker.cache_generations import generations_of
from asyncinfer.worker.dead_letters import options_of
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["cache_key_of", "CacheWrites", "store_with_cache"]

log = logging.getLogger(__name__)


def cache_key_of(app: Celery, d: TakenMessage, kwargs: Any) -> str:
    """The response cache entry ``d``'s answer fills, once it is routed (worker/runtime.py): ''
    unless its model caches answers (``response_cache``), the request is keyable and does not
    bypass it, and the weights that run it are known (worker/cache_generations.py: the routes did
    not change since it was taken). The entry names those weights: a look-up finds it only while
    they answer such requests."""
    model = d.model
    if not model or d.headers.get("task") != TASK_NAME or not isinstance(kwargs, Mapping):
        return ""
    if not options_of(app, model).response_cache:
        return ""
    generations = generations_of(app)
    stem = cache_key(model, kwargs) if generations is not None else None
    if generations is None or not stem:
        return ""
    token = generations.entry_token(generation_name(model, kwargs), d.received_at)
    return entry_key(stem, token) if token else ""


class CacheWrites:
    """The cache writes of one stored part of a batch, gathered per model (:meth:`add`), then
    queued with its store (:meth:`queue`)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._by_model: dict[str, list[tuple[str, bytes]]] = {}

    def add(self, d: TakenMessage, response: Any) -> None:
        """Gather ``d``'s successful ``response`` for its cache entry: its meta around a mark for
        the request ID, with ``cache_hit`` in its parameters. Never fails the request (an answer
        that cannot be cached is logged and stands)."""
        try:
            cached = dict(response)
            cached["id"] = response_cache.MARK
            cached["parameters"] = {**(cached.get("parameters") or {}), "cache_hit": True}
            meta = result_meta(response_cache.MARK, states.SUCCESS, cached,
                               parent_id=d.headers.get("parent_id"))
            stored = response_cache.template(encode_meta(self.app.backend, meta))
        except Exception:  # noqa: BLE001 - the answer stands; it is only not cached
            log.exception("request %s: its answer could not be cached", d.request_id)
            return
        model = d.model or d.queue
        self._by_model.setdefault(model, []).append((d.cache_key, stored))

    def __bool__(self) -> bool:
        return bool(self._by_model)

    def clear(self) -> None:
        """Forget what was gathered (a part stored again gathers it again)."""
        self._by_model = {}

    def queue(self, pipe: Any) -> None:
        """Queue what was gathered on ``pipe`` (one script call per model), and start again."""
        for model, entries in self._by_model.items():
            options = options_of(self.app, model)
            response_cache.write(pipe, model, entries, ttl_s=options.response_cache_ttl_s,
                                 max_entries=options.response_cache_max_entries)
        self._by_model = {}


def store_with_cache(client: Any, store: StoreScript, entries: list[Entry],
                     writes: CacheWrites,
                     untraced: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Store ``entries`` with ``store`` and write the gathered cache answers, in one round trip
    on ``client`` (the broker): the cache writes first, so a request repeated once its answer is
    out finds it; the traces of ``untraced`` go (store.py). The error replies of the store and
    the result keys it left out (as text: store.py's :func:`store_reply`); a refused cache write
    is logged and dropped (a later miss). Raises what a refused store raises (out of memory: the
    writer splits the part)."""
    pipe = client.pipeline(transaction=False)
    writes.queue(pipe)
    store.queue(pipe, entries, untraced or ())
    *cached, stored = pipe.execute(raise_on_error=False)
    for error in (r for r in cached if isinstance(r, Exception)):
        log.warning("writing answers to the response cache failed: %s", error)
    if isinstance(stored, redis.exceptions.NoScriptError):  # a restarted or new master
        store.load(client)
        return store.call(entries, client, untraced or ())
    if isinstance(stored, redis.ResponseError):
        raise as_out_of_memory(stored)
    errors, skipped = store_reply(stored)
    return errors, [keyspace(client).name(key) for key in skipped]
