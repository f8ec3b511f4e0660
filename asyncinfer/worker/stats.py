"""A device worker's share of the fleet statistics (asyncinfer/broker/fleet_stats.py): counted in the
process, added to Redis in the background.

The runner's batch observer and the settlement call :meth:`StatsCounts.record_batch` once per
device batch and :meth:`StatsCounts.record_failure` once per failed request: a few additions under
a lock, never a Redis call. A :class:`StatsFlusher` thread takes what was counted since its last
flush every ``interval_s`` (nothing counted: no Redis call) and adds it with HINCRBY to the
worker's hash of each model, in one pipeline; a flush that fails keeps its counts for the next.
The last flush is made at a clean stop. Counts are cumulative per Redis (broker/fleet_stats.py says how
long a hash is kept).

Times are nanoseconds, as Triton's. Per request: ``queue`` is the time the worker held it, from
its take to its batch forming (Triton's queue: the server's own); ``redis_wait`` the time the
message lay in Redis, from its producer's ``asyncinfer_sent_at`` to the worker's take (clocks of
two hosts: skew shows in it); ``compute_input`` / ``compute_infer`` / ``compute_output`` its
batch's preprocess (formed → launched), copies and forward (→ results on the host), and
postprocess; ``success`` the sum of queue and compute; ``fail`` the take to the failure. Per batch
size: the batch's own times.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import redis

from asyncinfer.broker.connections import bounded_client
from asyncinfer.broker.fleet_stats import FleetStats
from asyncinfer.broker.urls import is_redis_url
from asyncinfer.config.settings import Settings

__all__ = ["StatsCounts", "StatsFlusher", "flusher_for"]

log = logging.getLogger(__name__)

_NS = 1_000_000_000
_PHASES = ("compute_input", "compute_infer", "compute_output")


class StatsCounts:
    """Per model, what was counted since the last :meth:`take` (field → integer), and when the
    model last ran (ms since the epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, defaultdict[str, int]] = {}
        self._last_ms: dict[str, int] = {}

    def _of(self, model: str) -> defaultdict[str, int]:
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = defaultdict(int)
        return counts

    def record_batch(self, model: str, rows: int, requests: int, waits_s: Sequence[float],
                     phases_s: tuple[float, float, float]) -> None:
        """One device batch of ``rows`` rows for ``requests`` requests, which waited ``waits_s``
        in the worker; its preprocess, device and postprocess took ``phases_s``."""
        phases_ns = [int(p * _NS) for p in phases_s]
        compute_ns = sum(phases_ns)
        queue_ns = int(sum(waits_s) * _NS)
        prefix = f"batch:{rows}:"
        now_ms = int(time.time() * 1000)
        with self._lock:
            c = self._of(model)
            c["execution_count"] += 1
            c["inference_count"] += rows
            c["success_count"] += requests
            c["success_ns"] += queue_ns + requests * compute_ns
            c["queue_count"] += requests
            c["queue_ns"] += queue_ns
            for phase, ns in zip(_PHASES, phases_ns, strict=True):
                c[phase + "_count"] += requests
                c[phase + "_ns"] += requests * ns
                c[prefix + phase + "_count"] += 1
                c[prefix + phase + "_ns"] += ns
            self._last_ms[model] = now_ms

    def record_failure(self, model: str, duration_s: float = 0.0) -> None:
        """One request of ``model`` failed, ``duration_s`` after the worker took it."""
        with self._lock:
            c = self._of(model)
            c["fail_count"] += 1
            c["fail_ns"] += int(duration_s * _NS)

    def record_redis_waits(self, model: str, waits_s: Sequence[float]) -> None:
        """Requests of ``model`` lay ``waits_s`` in Redis before the worker took them."""
        with self._lock:
            c = self._of(model)
            c["redis_wait_count"] += len(waits_s)
            c["redis_wait_ns"] += int(sum(max(0.0, w) for w in waits_s) * _NS)

    def take(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """What was counted since the last take (emptied), and each model's last run."""
        with self._lock:
            counts, self._counts = self._counts, {}
            last, self._last_ms = self._last_ms, {}
        return {m: dict(c) for m, c in counts.items() if c}, last

    def give_back(self, counts: dict[str, dict[str, int]], last_ms: dict[str, int]) -> None:
        """Put counts a flush could not store back, to go with the next."""
        with self._lock:
            for model, fields in counts.items():
                c = self._of(model)
                for name, n in fields.items():
                    c[name] += n
            for model, ms in last_ms.items():
                self._last_ms[model] = max(ms, self._last_ms.get(model, 0))


class StatsFlusher:
    """Adds ``counts`` to Redis for ``worker`` (on ``device``) every ``interval_s`` until
    :meth:`stop`, which flushes once more."""

    def __init__(self, fleet: FleetStats, counts: StatsCounts, worker: str, device: str, *,
                 interval_s: float = 1.0) -> None:
        self.fleet = fleet
        self.counts = counts
        self.worker = worker
        self.device = device
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncinfer-stats", daemon=True)

    def start(self) -> StatsFlusher:
        self._thread.start()
        return self

    def flush(self) -> bool:
        """Add what was counted since the last flush; False (the counts kept) if Redis failed."""
        counts, last_ms = self.counts.take()
        if not counts and not last_ms:
            return True
        try:
            self.fleet.add(self.worker, self.device, counts, last_ms)
        except redis.RedisError as exc:
            log.warning("statistics: flush failed (%s: %s); kept for the next", type(exc).__name__,
                        exc)
            self.counts.give_back(counts, last_ms)
            return False
        return True

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.flush()

    def stop(self) -> None:
        """Stop the thread and flush what is left."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.flush()



def flusher_for(settings: Settings, worker: str, device: str, counts: StatsCounts
                ) -> StatsFlusher | None:
    """A started flusher of ``counts`` for ``worker`` (none without a Redis result backend)."""
    backend = settings.resolved_result_backend()
    if not is_redis_url(backend):
        return None
    fleet = FleetStats(bounded_client(backend, settings), retention_s=settings.model_retention_s)
    return StatsFlusher(fleet, counts, worker, device).start()
