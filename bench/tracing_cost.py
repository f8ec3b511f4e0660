"""What tracing costs the requests' path: tracing off against on (OTLP to a local sink), in turn.

    PYTHONPATH=. .venv/bin/python bench/tracing_cost.py [--rounds 3] [--requests 4000] [--sample 0.01]

One embedded Redis. Each run starts a CPU worker with ``ASYNCINFER_TRACING`` off or ``otlp``
(exporting over OTLP/HTTP to a sink process that answers 200 and keeps nothing) and drives it
from a ``Client`` of the same mode, so a traced run carries a ``traceparent`` from the caller
through the worker. Two measures per run:

- ``identity`` at 1 in flight: p50 and p99 of ``client.infer``;
- ``mlp`` at 256 in flight: throughput and the CPU ms per request of the worker, Redis and the
  client.

The modes alternate (off, on, then on, off, ...), so both meet the same moments of the host.
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
from asyncinfer.supervision.processes import stop_process

SINK = r'''
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
'''


def _latency(client: Client, requests: int) -> dict[str, float]:
    x = np.zeros((1, 16), dtype=np.float32)
    client.infer("identity", x, timeout_s=30)
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        client.infer("identity", x, timeout_s=30)
        times.append((time.perf_counter() - start) * 1000)
    return {"identity_p50_ms": percentile(times, 50), "identity_p99_ms": percentile(times, 99)}


def _load(client: Client, requests: int, pids: dict[str, int]) -> dict[str, float]:
    inputs = np.random.default_rng(0).standard_normal((64, 1, 16)).astype(np.float32)
    # one window first, unmeasured: a worker just started can leave its first window waiting
    # about a second (its start-up's Celery mingle; a predecessor's watch of a list, still alive)
    run_closed_loop("mlp", lambda i: client.submit("mlp", inputs[i % 64]), 512, 256)
    cpu0 = {name: process_cpu_s(pid) for name, pid in pids.items()}
    client0 = time.process_time()
    result = run_closed_loop("mlp", lambda i: client.submit("mlp", inputs[i % 64]), requests, 256)
    cpu = {f"{name}_cpu_ms_per_req": round((process_cpu_s(pid) - cpu0[name]) * 1000 / requests, 3)
           for name, pid in pids.items()}
    cpu["client_cpu_ms_per_req"] = round((time.process_time() - client0) * 1000 / requests, 3)
    return {"mlp_rps": result.throughput, "mlp_p50_ms": percentile(result.latencies_ms, 50),
            "mlp_failures": result.failures, **cpu}


def _run(url: str, mode: str, folder: Path, redis_pid: int, sink_port: int,
         args: argparse.Namespace) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCINFER_", "OTEL_"))}
    env.update(ASYNCINFER_BROKER_URL=url, ASYNCINFER_LOG_LEVEL="warning", ASYNCINFER_TRACING=mode,
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}")
    if args.sample is not None:  # OpenTelemetry's own sampler settings, in every process
        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                   OTEL_TRACES_SAMPLER_ARG=str(args.sample))
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        if name in env:
            os.environ[name] = env[name]
    worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                               "--models", "identity,mlp"], env=env,
                              stdout=open(folder / f"worker-{mode}.log", "ab"),
                              stderr=subprocess.STDOUT)
    try:
        wait_hosted(url, "mlp", worker)
        with Client(settings=Settings(broker_url=url, tracing=mode)) as client:
            line: dict[str, object] = {"tracing": mode, "sample": args.sample}
            line.update(_latency(client, args.latency_requests))
            line.update(_load(client, args.requests, {"worker": worker.pid, "redis": redis_pid}))
            return line
    finally:
        stop_process(worker, 15, 30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000, help="per mlp run")
    parser.add_argument("--latency-requests", type=int, default=500)
    parser.add_argument("--sample", type=float, help="trace this share of requests (a ratio "
                        "sampler at the root; default: every one)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    port, sink_port = free_port(), free_port()
    redis = subprocess.Popen([redis_server_binary(), "--port", str(port), "--save", "",
                              "--appendonly", "no", "--dir", str(folder)],
                             stdout=subprocess.DEVNULL)
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(sink_port)])
    runs = 0
    try:
        for round_ in range(args.rounds):
            for mode in ("off", "otlp") if round_ % 2 == 0 else ("otlp", "off"):
                url = f"redis://127.0.0.1:{port}/{runs % 16}"  # a database per run: no state left
                runs += 1
                print(json.dumps(_run(url, mode, folder, redis.pid, sink_port, args)), flush=True)
    finally:
        stop_process(sink, 15, 10)
        stop_process(redis, 15, 10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
