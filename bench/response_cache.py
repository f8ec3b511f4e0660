"""What the response cache costs and saves, on one embedded Redis and one CPU worker.

    PYTHONPATH=. .venv/bin/python bench/response_cache.py [--rounds 3] [--requests 4000]

Two measures, each A/B in alternation (``--rounds`` pairs, same worker, same client):

- **latency at 1 in flight** (``identity``): ``hit`` (the same request again and again: a hit each
  time, after the first), ``miss`` (every request distinct, cache on: the look-up and the write
  on the way) and ``off`` (distinct, ``parameters.response_cache`` false: a device run as without
  the cache); p50 and p99 of ``client.infer``.
- **the cost of the check**: ``mlp`` at 256 in flight, every request distinct (cache on: a key,
  a look-up in the publish script, a miss count, the worker's template and write) against the same
  load bypassing the cache (what a model without it does: a plain LPUSH, no write); throughput
  and the CPU ms per request of the worker, Redis and the client.

Prints one JSON line per run. A script, not a test: compare only runs of the same sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from client_ab import wait_hosted  # this folder is first on sys.path when run as a script

from asyncinfer import Client
from asyncinfer.config.settings import Settings
from asyncinfer.ops.benchmark.loadgen import percentile, run_closed_loop
from asyncinfer.ops.benchmark.systems import process_cpu_s
from asyncinfer.ops.redis_server import free_port, redis_server_binary

OPTIONS = json.dumps({"identity": {"response_cache": True}, "mlp": {"response_cache": True}})
BYPASS = {"response_cache": False}


def _latency(client: Client, variant: str, requests: int, seed: int) -> dict[str, float]:
    """p50/p99 of ``identity`` at 1 in flight: ``hit`` (one request again and again), ``miss``
    (every request distinct, cache on) or ``off`` (distinct, bypassing the cache)."""
    rng = np.random.default_rng(seed)  # a run's own inputs: no hit on another run's answers
    xs = rng.standard_normal((requests + 1, 1, 16)).astype(np.float32)
    if variant == "hit":
        xs[:] = xs[0]
    options = {"parameters": BYPASS} if variant == "off" else {}
    client.infer("identity", xs[0], timeout_s=30, **options)
    times = []
    for x in xs[1:]:
        start = time.perf_counter()
        client.infer("identity", x, timeout_s=30, **options)
        times.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": percentile(times, 50), "p99_ms": percentile(times, 99)}


def _load(client: Client, bypass: bool, requests: int, start: int, pids: dict[str, int]
          ) -> dict[str, float]:
    rng = np.random.default_rng(start)
    inputs = rng.standard_normal((requests, 1, 16)).astype(np.float32)  # all distinct: misses
    options = {"parameters": BYPASS} if bypass else {}
    cpu0 = {name: process_cpu_s(pid) for name, pid in pids.items()}
    client0 = time.process_time()
    result = run_closed_loop("mlp", lambda i: client.submit("mlp", inputs[i], **options),
                             requests, 256)
    cpu = {f"{name}_cpu_ms_per_req": (process_cpu_s(pid) - cpu0[name]) * 1000 / requests
           for name, pid in pids.items()}
    cpu["client_cpu_ms_per_req"] = (time.process_time() - client0) * 1000 / requests
    return {"throughput_rps": result.throughput, "p50_ms": percentile(result.latencies_ms, 50),
            "failures": result.failures, **cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000, help="per mlp run")
    parser.add_argument("--latency-requests", type=int, default=500)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    port = free_port()
    redis = subprocess.Popen([redis_server_binary(), "--port", str(port), "--save", "",
                              "--appendonly", "no", "--dir", str(folder)],
                             stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "ASYNCINFER_BROKER_URL": url, "ASYNCINFER_MODEL_OPTIONS": OPTIONS,
           "ASYNCINFER_LOG_LEVEL": "warning"}
    worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                               "--models", "identity,mlp"], env=env,
                              stdout=open(folder / "worker.log", "wb"), stderr=subprocess.STDOUT)
    try:
        time.sleep(0.5)
        wait_hosted(url, "mlp", worker)
        client = Client(settings=Settings(broker_url=url, model_options=OPTIONS,
                                          model_retention_s=0))
        pids = {"worker": worker.pid, "redis": redis.pid}
        for round_ in range(args.rounds):
            variants = ["hit", "miss", "off"]
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                print(json.dumps({"measure": "identity 1 in flight", "variant": variant,
                                  **_latency(client, variant, args.latency_requests,
                                            1000 + 10 * round_ + variants.index(variant))}), flush=True)
            for bypass in (False, True) if round_ % 2 == 0 else (True, False):
                name = "cache off (bypass)" if bypass else "cache on, all misses"
                print(json.dumps({"measure": "mlp 256 in flight", "variant": name,
                                  **_load(client, bypass, args.requests, round_ * 2 + bypass,
                                          pids)}), flush=True)
        client.close()
    finally:
        worker.terminate()
        worker.wait(30)
        redis.terminate()
        redis.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
