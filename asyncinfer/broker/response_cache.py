"""The response cache (Triton's ``response_cache``): a deterministic model's answers, kept in Redis
and given again for the same request without a trip to the queue or the device.

Opt-in per model (``ASYNCINFER_MODEL_OPTIONS`` ``{"mlp": {"response_cache": true}}``, read by the
clients and the workers alike). Where each part happens:

- **the look-up, at submit, in the publish script** (broker/publisher.py). A request of a cached
  model carries its key (wire/cache_key.py); the script that would push it reads the key first,
  and on a hit stores the cached answer under the request's own ID, announces it as a worker
  would, and pushes nothing. It is the round trip the publish makes anyway: a hit costs no extra
  round trip, and neither does a miss. A hit skips the queue, the worker and the device.
- **the write, by the worker**, in the round trip that stores the results of a batch, just before
  them (one script call per model; worker/output/cache_write.py): once an answer is out, a
  repeat of its request finds it. A failure, a retry, a revocation or an answer that could not be
  encoded is never cached, nor a request whose own row of a batch failed.
- **the bound**: every entry has a TTL (``response_cache_ttl_s``), and a model keeps at most
  ``response_cache_max_entries`` (a sorted set of its entries by write time, trimmed by the write
  that passes the bound: the oldest go first). The bound is ours rather than Redis'
  ``maxmemory-policy``, which is the operator's and covers the queues too.
- **the counts**: hits and misses per model in ``asyncinfer:cache:stats:<model>``
  (:func:`cache_stats`).
- **the weights**: a model's cached answers follow its weights. Each load of a model with the cache
  on gives its weights a token (worker/cache_generations.py: a model file's content hash, a
  built-in's fixed one, else one of its own per load); each entry's key ends with the token of the
  weights that computed it, and ``asyncinfer:cache:generation:<name>`` holds the token that answers
  the requests of ``<name>`` now (the model, for requests naming no version: its latest; ``m@v`` for
  those naming version ``v``). A worker's load, unload or reload of a version sets the
  generations it changes (:func:`record_generations`) before its requests route the new way; the
  look-up reads the generation first and looks for that token's entry only, and a write is kept
  only when its token is still its generation's. So an answer of weights that no longer answer is
  never found; its entry lapses with its TTL, and meanwhile counts in the model's bound.

What is stored is the answer's result meta around its request ID (:func:`template`): the script
puts the new request's ID in its places, so the hit's stored result, ``AsyncResult(id).get()``,
its future and the gateway's reply are those of an answered request: the same outputs, datatypes
and shapes; its ``parameters`` are the run's that computed it (worker, device, times) with
``cache_hit: true``.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from asyncinfer.broker.scripts import script
from asyncinfer.wire.cache_key import split_entry
from asyncinfer.wire.keys import (
    response_cache_generation_key,
    response_cache_index_key,
    response_cache_stats_key,
)

__all__ = ["template", "fill", "write", "cache_stats", "purge", "record_generations",
           "WRITE_SCRIPT", "GENERATIONS_SCRIPT", "MARK"]

#: Stands for the request ID while the template is encoded (unguessable, so no answer holds it;
#: the template records where it stood, so another process's mark fills the same).
MARK = f"asyncinfer-cached-request-id-{secrets.token_hex(16)}"
_QUOTED_MARK = json.dumps(MARK)

WRITE_SCRIPT = script("response_cache_write")
GENERATIONS_SCRIPT = script("response_cache_generations")


def template(encoded: str | bytes) -> bytes:
    """The stored form of a result meta encoded with :data:`MARK` as its request ID: the lengths
    of the pieces between the ID's places, then the pieces (``12,340,88;{"status": ...``)."""
    text = encoded.encode() if isinstance(encoded, str) else encoded
    pieces = text.split(_QUOTED_MARK.encode())
    return ",".join(str(len(p)) for p in pieces).encode() + b";" + b"".join(pieces)


def fill(stored: bytes, request_id: str) -> bytes:
    """The result meta of ``request_id`` from its template (what the publish script does)."""
    head, _, body = stored.partition(b";")
    pieces, at = [], 0
    for length in (int(n) for n in head.split(b",")):
        pieces.append(body[at:at + length])
        at += length
    return json.dumps(request_id).encode().join(pieces)


def write(pipe: Any, model: str, entries: list[tuple[str, bytes]], *, ttl_s: float,
          max_entries: int, now_ms: int | None = None) -> None:
    """Queue the write of ``model``'s cached answers (entry key, template) on ``pipe``: each is
    stored only while the weights token its key ends with is its generation's
    (wire/cache_key.py's :func:`~asyncinfer.wire.cache_key.entry_key`). As EVAL, not a
    registered script: a pipeline holding one asks Redis whether it has the script first, a round
    trip per write; EVAL of a script Redis has seen costs it a hash of the text."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    # a few slices for a very large batch: one script call holds Redis while it runs
    for start in range(0, len(entries), 1024):
        part = entries[start:start + 1024]
        keys: list[str] = [response_cache_index_key(model)]
        args: list[Any] = [max(1, int(ttl_s * 1000)), max_entries, now_ms]
        for key, stored in part:
            generation, token = split_entry(key)
            keys += [key, generation]
            args += [token, stored]
        pipe.eval(WRITE_SCRIPT, len(keys), *keys, *args)


def cache_stats(client: Any, model: str) -> dict[str, int]:
    """``model``'s cache counts: ``hits``, ``misses`` (since the counts were last purged) and
    ``entries`` (held now, at most ``response_cache_max_entries``; a few may have expired since the
    last write)."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(response_cache_stats_key(model), ["hits", "misses"])
    pipe.zcard(response_cache_index_key(model))
    (hits, misses), entries = pipe.execute()
    return {"hits": int(hits or 0), "misses": int(misses or 0), "entries": int(entries)}


def record_generations(client: Any, set_tokens: dict[str, str],
                       removed: dict[str, str]) -> int:
    """Record which weights answer now: generation name → token for ``set_tokens``; for
    ``removed``, the name's generation goes if it still holds that token (another worker's later
    load stands). A name is a model, or ``model@version`` (wire/cache_key.py). How many changed."""
    names = list(set_tokens) + list(removed)
    if not names:
        return 0
    args: list[str] = []
    for token in set_tokens.values():
        args += ["+", token]
    for token in removed.values():
        args += ["-", token]
    keys = [response_cache_generation_key(name) for name in names]
    return int(client.eval(GENERATIONS_SCRIPT, len(keys), *keys, *args))


def purge(client: Any, model: str) -> int:
    """Drop ``model``'s cached answers and counts; how many entries went. Not needed when its
    weights change (a load does what is needed: see the weights above); the generations stay."""
    index = response_cache_index_key(model)
    keys = [k.decode() if isinstance(k, bytes) else k for k in client.zrange(index, 0, -1)]
    pipe = client.pipeline(transaction=True)
    for start in range(0, len(keys), 512):
        pipe.delete(*keys[start:start + 512])
    pipe.delete(index, response_cache_stats_key(model))
    pipe.execute()
    return len(keys)
