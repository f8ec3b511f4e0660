"""Two client versions against one worker, alternated: where a client-side change moves the work.

    .venv/bin/python bench/client_ab.py --old /path/to/old/tree --new /path/to/new/tree \\
        [--worker-tree /path/to/tree] [--pairs 5] [--levels 1,64,256] [--model mlp] \\
        [--redis-rtt-ms 2] [--requests 15000] [--out results.jsonl]

``--old`` and ``--new`` are source trees of asyncinfer (``git worktree add /tmp/old REV``), put
first on ``PYTHONPATH`` of each client process; the worker runs ``--worker-tree`` (default: the new
one). One embedded Redis and one worker serve every run, so only the client differs. Each run
prints one JSON line per level: throughput, p50, mean device batch, CPU ms per request of the
client, the worker and Redis, and Redis commands per request (``INFO commandstats``). A script,
not a test: this machine is too noisy for timed assertions.

``--redis-rtt-ms R`` runs every client twice in turn, on loopback and through a delay proxy that
puts Redis R ms (a round trip) away (asyncinfer/ops/benchmark/latency_proxy.py); the worker always talks
to Redis directly. ``--model sim-fast`` (or sim-slow) serves the bench's simulated device.
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

_CLIENT = r'''
import json, os, sys, time
import numpy as np
import redis
from asyncinfer import Client
try:
    from asyncinfer.ops.benchmark.loadgen import percentile, run_closed_loop
    from asyncinfer.ops.benchmark.systems import process_cpu_s
except ImportError:  # a tree from before the benchmark moved under ops/
    from asyncinfer.bench.loadgen import percentile, run_closed_loop
    from asyncinfer.bench.systems import process_cpu_s

url, worker_pid, redis_pid, tag, model, levels, rtt_ms, requests = sys.argv[1:9]
client, stats = Client(broker_url=url), redis.Redis.from_url(url)
x = np.ones((1, 16), np.float32) if model == "mlp" else np.ones((1, 4), np.float32)
calls = lambda: {k: v["calls"] for k, v in stats.info("commandstats").items()}
for f in [client.submit(model, x) for _ in range(200)]:
    f.result(timeout=30)
for level in map(int, levels.split(",")):
    total = max(1, int(requests) // 10) if level == 1 else int(requests)
    s0, c0 = calls(), time.process_time()
    w0, r0 = process_cpu_s(int(worker_pid)), process_cpu_s(int(redis_pid))
    res = run_closed_loop(tag, lambda i: client.submit(model, x), total, level)
    n, s1 = max(1, len(res.latencies_ms)), calls()
    sizes = res.batch_sizes
    print(json.dumps({
        "client": tag, "redis_rtt_ms": float(rtt_ms), "in_flight": level,
        "req_per_s": round(res.throughput, 1),
        "p50_ms": round(percentile(res.latencies_ms, 50), 3),
        "mean_batch": round(sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values())), 1),
        "cpu_ms_per_request": {"client": round((time.process_time() - c0) * 1e3 / n, 3),
                               "worker": round((process_cpu_s(int(worker_pid)) - w0) * 1e3 / n, 3),
                               "redis": round((process_cpu_s(int(redis_pid)) - r0) * 1e3 / n, 3)},
        "redis_commands_per_request": {k.removeprefix("cmdstat_"): round((s1[k] - s0.get(k, 0)) / n, 2)
                                       for k in s1 if (s1[k] - s0.get(k, 0)) / n >= 0.05},
        "failures": res.failures}), flush=True)
client.close()
'''


def wait_hosted(url: str, model: str, worker: subprocess.Popen[bytes]) -> None:
    """Return once the model catalogue shows ``model`` hosted by a live worker."""
    from asyncinfer.client import Client

    with Client(broker_url=url) as client:
        deadline = time.monotonic() + 120
        while not ((entry := client.models().get(model)) is not None and entry.ready):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit("the worker did not start")
            time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, type=Path)
    p.add_argument("--new", required=True, type=Path)
    p.add_argument("--worker-tree", type=Path)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--levels", default="1,64,256")
    p.add_argument("--model", default="mlp", help="mlp, identity, sim-fast or sim-slow")
    p.add_argument("--redis-rtt-ms", type=float, default=0.0,
                   help="also run each client with Redis this round trip away (0: loopback only)")
    p.add_argument("--requests", type=int, default=15000, help="per level (a tenth at 1 in flight)")
    p.add_argument("--out", type=Path, help="append each JSON line to this file too")
    args = p.parse_args()
    from asyncinfer.ops.benchmark.latency_proxy import LatencyProxy, ping_ms
    from asyncinfer.ops.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis", appendonly=False).start()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")},
               "ASYNCINFER_BROKER_URL": server.url, "ASYNCINFER_LOG_LEVEL": "warning",
               "PYTHONPATH": str(args.worker_tree or args.new)}
        if args.model.startswith("sim-"):
            env["ASYNCINFER_MODEL_FACTORIES"] = (
                f"{args.model}=asyncinfer.ops.benchmark.synthetic:{args.model.replace('-', '_')}")
        proxy = LatencyProxy(server.url, args.redis_rtt_ms).start() if args.redis_rtt_ms else None
        with open(Path(tmp) / "worker.log", "wb") as log:
            worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                                       "--models", args.model, "--hostname", "client-ab@%h"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_hosted(server.url, args.model, worker)
            assert server.process is not None
            urls = [(0.0, server.url)]
            if proxy is not None:
                print(json.dumps({"redis_rtt_ms": args.redis_rtt_ms,
                                  "ping_ms": {"loopback": round(ping_ms(server.url), 3),
                                              "proxied": round(ping_ms(proxy.url), 3)}}), flush=True)
                urls.append((args.redis_rtt_ms, proxy.url))
            for _ in range(args.pairs):
                for tag, tree in (("old", args.old), ("new", args.new)):
                    for rtt_ms, url in urls:
                        out = subprocess.run(
                            [sys.executable, "-c", _CLIENT, url, str(worker.pid),
                             str(server.process.pid), tag, args.model, args.levels, str(rtt_ms),
                             str(args.requests)],
                            env={**env, "PYTHONPATH": str(tree)}, check=True, stdout=subprocess.PIPE,
                            text=True, cwd=tree).stdout  # ``-c`` puts its cwd first on sys.path
                        print(out, end="", flush=True)
                        if args.out is not None:
                            with open(args.out, "a") as results:
                                results.write(out)
        finally:
            worker.terminate()
            worker.wait(30)
            if proxy is not None:
                proxy.stop()
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
