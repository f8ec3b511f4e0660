"""What marking a batch as on the device costs the device thread: the round trip it used to wait
for (a pipeline, reply read) against the send it does now (device_marks.py: replies off, no
wait), under GIL contention like a busy worker's.

    .venv/bin/python bench/device_marks_cost.py [--batches 200] [--rounds 3] [--busy-threads 2]

A device thread "runs" batches of 32 (sleeps ``--kernel-ms``, GIL released, as the sim device
does) and marks each before it starts; ``--busy-threads`` threads meanwhile do what the worker's
result writer and intake do: Python work with a Redis round trip every ``--busy-ms``. Prints one
JSON line per variant and round: the mark's wall time on the device thread (median, p90, mean),
in ms. Variants alternate; compare only runs of the same sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis

from asyncinfer.broker.device_marks import DeviceMarks
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.ops.redis_server import RedisServer
from asyncinfer.wire.keys import LEASE_DEVICE_KEY


def _waited(client: redis.Redis):  # noqa: ANN202 - the old way: a pipeline, its reply awaited
    marked: list[str] = []

    def mark(batch: list[tuple[str, str, WorkItem]]) -> None:
        pipe = client.pipeline(transaction=False)
        if marked:
            pipe.hdel(LEASE_DEVICE_KEY, *marked)
        pipe.hset(LEASE_DEVICE_KEY, items=[v for tag, rid, _ in batch for v in (tag, rid)])
        pipe.execute()
        marked[:] = [tag for tag, _, _ in batch]
    return mark


def _sent(client: redis.Redis):  # noqa: ANN202 - the new way
    marks = DeviceMarks(client)
    last: list[WorkItem] = []

    def mark(batch: list[tuple[str, str, WorkItem]]) -> None:
        for item in last:
            item.on_device = False
        marks.on_device(batch)
        last[:] = [item for _, _, item in batch]
    return mark


def _busy(url: str, stop: threading.Event, busy_ms: float) -> None:
    client = redis.Redis.from_url(url, single_connection_client=True)
    while not stop.is_set():
        until = time.perf_counter() + busy_ms / 1000
        n = 0
        while time.perf_counter() < until:  # Python work, holding the GIL
            n += 1
        client.hset("bench:busy", "n", n)  # then a round trip, as the result writer's


def _run(variant: str, url: str, args: argparse.Namespace) -> dict[str, object]:
    client = redis.Redis.from_url(url)
    mark = (_waited if variant == "waited" else _sent)(client)
    stop = threading.Event()
    busy = [threading.Thread(target=_busy, args=(url, stop, args.busy_ms), daemon=True)
            for _ in range(args.busy_threads)]
    for t in busy:
        t.start()
    times_ms = []
    for b in range(args.batches):
        batch = [(f"t-{b}-{i}", f"r-{b}-{i}", WorkItem(request=None, rows=1, signature=(),
                                                       on_device=True)) for i in range(32)]
        t0 = time.perf_counter()
        mark(batch)
        times_ms.append((time.perf_counter() - t0) * 1e3)
        time.sleep(args.kernel_ms / 1000)
    stop.set()
    for t in busy:
        t.join()
    client.close()
    times_ms.sort()
    return {"variant": variant, "batches": args.batches,
            "median_ms": round(statistics.median(times_ms), 3),
            "p90_ms": round(times_ms[int(len(times_ms) * 0.9)], 3),
            "mean_ms": round(statistics.fmean(times_ms), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy-threads", type=int, default=2)
    p.add_argument("--busy-ms", type=float, default=2.0)
    p.add_argument("--kernel-ms", type=float, default=52.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis", appendonly=False).start()
        try:
            for _ in range(args.rounds):
                for variant in ("waited", "sent"):
                    print(json.dumps(_run(variant, server.url, args)), flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
