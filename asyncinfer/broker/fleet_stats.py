"""The fleet's inference statistics in Redis, summed over its workers in Triton's form.

Each device worker adds what it counted (worker/stats.py) to a hash of its own per model,
``asyncinfer:stats:<model>:<worker>`` (integer fields, HINCRBY, and ``device`` and
``last_inference``), and names the hash in the set ``asyncinfer:stats:index`` (members
``model\\tworker``). Counts are cumulative per Redis, not per worker life: a worker's hash
outlives it, kept ``retention_s`` (the model retention window, a day by default) after its last
flush, so a fleet's totals do not drop when a worker stops. A hash that lapsed leaves the index
at the next read.

:meth:`FleetStats.model_stats` gives Triton's ``ModelStatistics`` as JSON (the statistics
extension's HTTP form): success, fail, queue, compute_input / compute_infer / compute_output
(count and ns), inference and execution counts, last inference (ms), per batch size; and, under
the extra key ``asyncinfer`` (Triton's clients ignore it), the requests' wait in Redis and the
same statistics per worker and per device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from asyncinfer.wire.keys import STATS_INDEX_KEY, STATS_PREFIX, response_cache_stats_key

__all__ = ["FleetStats", "triton_stats", "DURATIONS"]

#: Triton's InferStatistics durations, in its order.
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")
_BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")
_SEP = "\t"
_TEXT_FIELDS = ("device",)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def stats_key(model: str, worker: str) -> str:
    """The hash of ``worker``'s counts of ``model``."""
    return f"{STATS_PREFIX}{model}:{worker}"


class FleetStats:
    """Adds a worker's counts and reads the fleet's, on a Redis client (the result backend's)."""

    def __init__(self, client: Any, *, retention_s: float = 86400.0) -> None:
        self.client = client
        self.retention_s = max(1, int(retention_s))

    def add(self, worker: str, device: str, counts: Mapping[str, Mapping[str, int]],
            last_ms: Mapping[str, int]) -> None:
        """Add ``counts`` (model → field → amount) to ``worker``'s hashes, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for model in dict.fromkeys([*counts, *last_ms]):
            key = stats_key(model, worker)
            for field, amount in counts.get(model, {}).items():
                if amount:
                    pipe.hincrby(key, field, amount)
            pipe.hset(key, "device", device)
            if model in last_ms:  # one worker's own clock only moves on
                pipe.hset(key, "last_inference", last_ms[model])
            pipe.expire(key, self.retention_s)
            pipe.sadd(STATS_INDEX_KEY, model + _SEP + worker)
        pipe.expire(STATS_INDEX_KEY, self.retention_s)
        pipe.execute()

    def read(self, model: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Per model (``model`` only, when given), each worker's hash: ``worker``, ``device`` and
        its integer fields."""
        members = sorted(_text(m) for m in self.client.smembers(STATS_INDEX_KEY))
        pairs = [(m, w) for m, _, w in (member.partition(_SEP) for member in members)
                 if w and (model is None or m == model)]
        if not pairs:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for m, w in pairs:
            pipe.hgetall(stats_key(m, w))
        found: dict[str, list[dict[str, Any]]] = {}
        gone = []
        for (m, w), raw in zip(pairs, pipe.execute(), strict=True):
            if not raw:
                gone.append(m + _SEP + w)
                continue
            fields = {_text(k): _text(v) for k, v in raw.items()}
            entry: dict[str, Any] = {"worker": w, "device": fields.pop("device", "")}
            entry.update({k: int(v) for k, v in fields.items() if k not in _TEXT_FIELDS})
            found.setdefault(m, []).append(entry)
        if gone:
            self.client.srem(STATS_INDEX_KEY, *gone)
        return found

    def model_stats(self, models: Iterable[str] = (), *, version: str = "1",
                    model: str | None = None) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` list: one entry per model with counts (``model``: that one
        only), and one of zeros for each of ``models`` that has none yet."""
        per_model = self.read(model)
        names = sorted(set(per_model) | set(models)) if model is None else [model]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(response_cache_stats_key(name), ["hits", "misses"])
        cached = pipe.execute() if names else []
        return [triton_stats(name, per_model.get(name, []), version,
                             cache=(int(hits or 0), int(misses or 0)))
                for name, (hits, misses) in zip(names, cached, strict=True)]


def _sum(entries: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for entry in entries:
        for k, v in entry.items():
            if k == "last_inference":
                total[k] = max(total.get(k, 0), v)
            elif isinstance(v, int):
                total[k] = total.get(k, 0) + v
    return total


def _duration(counts: Mapping[str, int], name: str) -> dict[str, int]:
    return {"count": counts.get(name + "_count", 0), "ns": counts.get(name + "_ns", 0)}


def _infer_stats(counts: Mapping[str, int]) -> dict[str, Any]:
    """Triton's ModelStatistics fields (without name and version) of summed counts."""
    sizes = sorted({int(k.split(":")[1]) for k in counts if k.startswith("batch:")})
    return {
        "last_inference": counts.get("last_inference", 0),
        "inference_count": counts.get("inference_count", 0),
        "execution_count": counts.get("execution_count", 0),
        "inference_stats": {d: _duration(counts, d) for d in DURATIONS},
        "batch_stats": [{"batch_size": size, **{d: _duration(counts, f"batch:{size}:{d}")
                                                for d in _BATCH_DURATIONS}} for size in sizes],
    }


def triton_stats(model: str, workers: list[dict[str, Any]], version: str = "1",
                 cache: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """One model's entry of Triton's ``model_stats``, summed over ``workers`` (from
    :meth:`FleetStats.read`), with the ``asyncinfer`` key: Redis wait, per worker, per device.
    ``cache``: the response cache's hits and misses (broker/response_cache.py), counted as Triton
    counts them: a hit is a success too; their ``ns`` are 0 (the lookup is inside the publish
    script, not timed)."""
    total = _sum(workers)
    hits, misses = cache
    if hits or misses:
        total = {**total, "cache_hit_count": hits, "cache_miss_count": misses,
                 "success_count": total.get("success_count", 0) + hits}
    devices: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        devices.setdefault(w["device"], []).append(w)
    return {
        "name": model, "version": version, **_infer_stats(total), "memory_usage": [],
        "asyncinfer": {
            "redis_wait": _duration(total, "redis_wait"),
            "workers": [{"worker": w["worker"], "device": w["device"], **_infer_stats(w),
                         "redis_wait": _duration(w, "redis_wait")} for w in workers],
            "devices": [{"device": d, **_infer_stats(_sum(ws))} for d, ws in sorted(devices.items())],
        },
    }
