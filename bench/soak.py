"""Soak run: many requests through one worker at a steady concurrency; does anything grow?

``.venv/bin/python bench/soak.py --requests 20000`` starts its own Redis and one worker, keeps
``--in-flight`` requests outstanding until ``--requests`` are done, samples the worker's resident
memory (``VmRSS``) and Redis' memory as it goes, and counts Redis keys before and after — by
prefix, and how many have no TTL (a key without one is kept forever). Prints a table and writes
``bench-results/soak.json`` (``--out bench/results/soak.json`` for the project's committed figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import numpy as np
import redis

from asyncinfer.constants import TASK_NAME, queue_for
from asyncinfer.ops.benchmark.loadgen import percentile, run_closed_loop
from asyncinfer.ops.benchmark.systems import WorkerUnderTest
from asyncinfer.ops.redis_server import RedisServer
from asyncinfer.wire.keys import RESULT_KEY_PREFIX, UNACKED_KEY

__all__ = ["main", "key_census", "rss_kib"]

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_NUMBER = re.compile(r"\d{4,}")


def rss_kib(pid: int) -> int:
    """Resident memory of process ``pid`` in KiB (``VmRSS`` of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def key_census(client: redis.Redis) -> dict[str, Any]:
    """DBSIZE, keys per prefix (request IDs folded into ``<id>``, long numbers into ``<n>``) and
    keys without a TTL."""
    by_prefix: Counter[str] = Counter()
    no_ttl: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        name = _NUMBER.sub("<n>", _UUID.sub("<id>", key.decode(errors="replace")))
        by_prefix[name] += 1
        if client.ttl(key) == -1:
            no_ttl[name] += 1
    return {"dbsize": int(client.dbsize()), "by_prefix": dict(by_prefix.most_common()),
            "without_ttl": dict(no_ttl.most_common()), "keys_without_ttl": sum(no_ttl.values()),
            "used_memory_bytes": int(client.info("memory")["used_memory"])}


class Sampler(threading.Thread):
    """Samples the worker's RSS and Redis' memory every ``every_s`` seconds until stopped."""

    def __init__(self, pid: int, client: redis.Redis, done: list[int], every_s: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.pid, self.client, self.done, self.every_s = pid, client, done, every_s
        self.samples: list[dict[str, Any]] = []
        self._stopping = threading.Event()
        self._began = time.monotonic()

    def sample(self) -> None:
        self.samples.append({
            "t_s": round(time.monotonic() - self._began, 1), "completed": self.done[0],
            "worker_rss_kib": rss_kib(self.pid),
            "redis_used_memory_bytes": int(self.client.info("memory")["used_memory"])})
        s = self.samples[-1]
        print(f"{s['t_s']:>7} s  {s['completed']:>7} done  worker RSS {s['worker_rss_kib'] / 1024:.1f} MiB",
              file=sys.stderr, flush=True)

    def run(self) -> None:
        while not self._stopping.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def where_is(client: redis.Redis, request_id: str, queue: str) -> str:
    """Where a request without a result lies in Redis: stored, taken, queued, or nowhere."""
    meta = client.get(RESULT_KEY_PREFIX + request_id)
    if meta is not None:
        status = json.loads(meta).get("status")
        return f"its result is stored ({status}) but the client did not hear of it"
    key = request_id.encode()
    if any(key in entry for entry in client.hvals(UNACKED_KEY)):
        return "taken by a worker, not acknowledged"
    if any(key in message for message in client.lrange(queue, 0, -1)):
        return "still in its queue"
    return "nowhere in Redis: lost"


class Watchdog(threading.Thread):
    """Fails the requests left outstanding when nothing completes for ``stall_s`` seconds,
    saying where each one lies, so that a soak run that loses requests ends and says so."""

    def __init__(self, client: redis.Redis, queue: str, done: list[int], stall_s: float) -> None:
        super().__init__(name="soak-watchdog", daemon=True)
        self.client, self.queue, self.done, self.stall_s = client, queue, done, stall_s
        self.pending: dict[str, Future[Any]] = {}
        self.stalled: list[dict[str, str]] = []
        self._stopping = threading.Event()

    def track(self, future: Future[Any]) -> Future[Any]:
        request_id = str(getattr(future, "id", ""))
        self.pending[request_id] = future
        future.add_done_callback(lambda f: self.pending.pop(request_id, None))
        return future

    def run(self) -> None:
        last, since = self.done[0], time.monotonic()
        while not self._stopping.wait(1.0):
            if self.done[0] != last or not self.pending:
                last, since = self.done[0], time.monotonic()
                continue
            if time.monotonic() - since < self.stall_s:
                continue
            for request_id, future in list(self.pending.items()):
                where = where_is(self.client, request_id, self.queue)
                self.stalled.append({"id": request_id, "where": where})
                try:
                    future.set_exception(TimeoutError(
                        f"request {request_id}: no result after {self.stall_s} s without progress; {where}"))
                except InvalidStateError:
                    pass  # it finished meanwhile
            since = time.monotonic()

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def _table(samples: list[dict[str, Any]]) -> str:
    lines = ["| t s | completed | worker RSS MiB | Redis used MiB |", "|---:|---:|---:|---:|"]
    for s in samples:
        lines.append(f"| {s['t_s']} | {s['completed']} | {s['worker_rss_kib'] / 1024:.1f} | "
                     f"{s['redis_used_memory_bytes'] / 2**20:.2f} |")
    return "\n".join(lines)


def _census_text(label: str, census: dict[str, Any]) -> str:
    parts = ", ".join(f"{k}: {v}" for k, v in census["by_prefix"].items()) or "none"
    missing = ", ".join(f"{k}: {v}" for k, v in census["without_ttl"].items()) or "none"
    return (f"{label}: DBSIZE {census['dbsize']} ({parts}); without TTL {census['keys_without_ttl']} "
            f"({missing}); used memory {census['used_memory_bytes'] / 2**20:.2f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=32, help="requests outstanding at once")
    parser.add_argument("--model", default="mlp", choices=["mlp", "identity"])
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--stall-s", type=float, default=60.0,
                        help="fail what is outstanding when nothing completes for this long")
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak.json"))
    args = parser.parse_args(argv)

    from asyncinfer.client import Client

    with tempfile.TemporaryDirectory(prefix="asyncinfer-soak-") as tmp:
        server = RedisServer(Path(tmp) / "redis", appendonly=False).start()
        hostname = f"soak@{socket.gethostname()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
        env.update(ASYNCINFER_BROKER_URL=server.url, ASYNCINFER_LOG_LEVEL="warning")
        worker = WorkerUnderTest("asyncinfer", [sys.executable, "-m", "asyncinfer", "worker",
                                                "--device", "cpu", "--models", args.model,
                                                "--hostname", hostname],
                                 env, Path(tmp) / "worker.log", hostname, TASK_NAME,
                                 queue_for(args.model))
        r = redis.Redis.from_url(server.url)
        client = Client(broker_url=server.url)
        try:
            worker.wait_ready(client.app)
            x = np.random.default_rng(0).random((1, 16), np.float32)
            client.infer(args.model, x, timeout_s=60)  # warm: model loaded, first batch run
            before = key_census(r)
            done = [0]
            sampler = Sampler(worker.process.pid, r, done, args.sample_every_s)
            sampler.sample()
            sampler.start()
            cpu_before = worker.cpu_s()

            watchdog = Watchdog(r, queue_for(args.model), done, args.stall_s)
            watchdog.start()

            def count() -> None:
                done[0] += 1

            load = run_closed_loop("soak", lambda i: watchdog.track(client.submit(args.model, x)),
                                   args.requests, args.in_flight, on_done=count)
            watchdog.stop()
            sampler.stop()
            time.sleep(1.0)  # the last acks
            sampler.sample()
            after = key_census(r)
            cpu_s = worker.cpu_s() - cpu_before
        finally:
            client.close()
            worker.stop()
            r.close()
            server.stop()

    samples = sampler.samples
    rss = [s["worker_rss_kib"] for s in samples]
    report = {
        "requests": args.requests, "in_flight": args.in_flight, "model": args.model,
        "completed": len(load.latencies_ms), "failures": load.failures, "errors": dict(load.errors),
        "elapsed_s": round(load.elapsed_s, 1), "throughput_rps": round(load.throughput, 1),
        "p50_ms": round(percentile(load.latencies_ms, 50), 2),
        "p99_ms": round(percentile(load.latencies_ms, 99), 2),
        "worker_cpu_ms_per_request": round(cpu_s * 1000 / max(1, args.requests), 3),
        "worker_rss_kib": {"start": rss[0], "end": rss[-1], "max": max(rss),
                           "growth": rss[-1] - rss[0]},
        "stalled": watchdog.stalled, "samples": samples, "redis_before": before,
        "redis_after": after,
    }
    print(_table(samples))
    print(f"\n{report['completed']} of {args.requests} completed, {load.failures} failed, "
          f"{report['throughput_rps']} req/s, p50 {report['p50_ms']} ms, p99 {report['p99_ms']} ms, "
          f"worker CPU {report['worker_cpu_ms_per_request']} ms/req")
    print(f"worker RSS: start {rss[0] / 1024:.1f} MiB, end {rss[-1] / 1024:.1f} MiB, "
          f"max {max(rss) / 1024:.1f} MiB")
    for stalled in watchdog.stalled:
        print(f"no result: request {stalled['id']}: {stalled['where']}")
    print(_census_text("Redis before", before))
    print(_census_text("Redis after", after))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if load.failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
