"""``make demo``: embedded Redis + a worker per device, a few hundred requests, a results table.

Runs ``asyncinfer up`` in a private state folder (so nothing outside it is touched), waits for its
workers, drives closed-loop load through the client with a live progress bar, prints p50/p99 and
throughput per workload, then stops ``up`` by its PID and checks that no process is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from asyncinfer.ops.benchmark.loadgen import LoadResult, run_closed_loop
from asyncinfer.supervision.processes import pid_alive, stop_process

__all__ = ["main"]


def _wait_for_workers(state_dir: Path, up: subprocess.Popen[bytes],
                      timeout_s: float) -> tuple[str, list[Any]]:
    from asyncinfer.celery_app import create_app
    from asyncinfer.config.published import published_url
    from asyncinfer.config.settings import Settings
    from asyncinfer.ops.status import cluster_status

    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"asyncinfer up exited with {up.returncode}")
        url = url or published_url(Settings(state_dir=str(state_dir)).redis_dir)
        if url:
            app = create_app(Settings(broker_url=url))
            try:
                workers = cluster_status(app, timeout_s=0.5).workers
            finally:
                app.close()
            if workers:
                return url, workers
        time.sleep(0.3)
    raise TimeoutError(f"no worker answered in {timeout_s} s")


def _table(results: list[LoadResult]) -> str:
    head = (f"{'workload':24} {'requests':>8} {'failures':>8} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'req/s':>8} {'mean batch':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        row = r.row()
        sizes = r.batch_sizes
        mean_batch = sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values()))
        lines.append(f"{row['name']:24} {row['requests']:>8} {row['failures']:>8} {row['p50_ms']:>8.2f} "
                     f"{row['p99_ms']:>8.2f} {row['throughput_rps']:>8.1f} {mean_batch:>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit status 0 when every request succeeded and nothing was left running."""
    parser = argparse.ArgumentParser(prog="asyncinfer-demo")
    parser.add_argument("--requests", type=int, default=300, help="requests per workload")
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="asyncinfer-demo-") as tmp:
        state = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
        env["ASYNCINFER_STATE_DIR"] = str(state)
        env.setdefault("ASYNCINFER_LOG_LEVEL", "warning")  # no per-request log lines in the table run
        http_port, grpc_port, metrics_port = _free_ports(3)  # never another server's 8000-8002
        env.update(ASYNCINFER_HTTP_PORT=str(http_port), ASYNCINFER_GRPC_PORT=str(grpc_port),
                   ASYNCINFER_GATEWAY_METRICS_PORT=str(metrics_port))
        up = subprocess.Popen([sys.executable, "-m", "asyncinfer", "up", "--models", "identity,mlp"],
                              env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        print(f"demo: started 'asyncinfer up' (pid {up.pid}), waiting for its workers …", flush=True)
        results: list[LoadResult] = []
        worker_pids: list[int] = []
        gateway_ok = False
        try:
            url, workers = _wait_for_workers(state, up, timeout_s=120)
            worker_pids = [w.pid for w in workers if w.pid]
            for w in workers:
                print(f"demo: worker {w.name} on {w.device} hosts {', '.join(w.models)}")
            from asyncinfer.client import Client

            rng = np.random.default_rng(0)
            with Client(broker_url=url) as client:
                client.infer("mlp", np.zeros((1, 16), np.float32), timeout_s=60)  # warm-up
                # (label, model, requests in flight, columns of one row)
                workloads = [("identity 1 in flight", "identity", 1, 8),
                             (f"identity {args.in_flight} in flight", "identity", args.in_flight, 8),
                             (f"mlp {args.in_flight} in flight", "mlp", args.in_flight, 16)]
                total = args.requests * len(workloads)
                with tqdm(total=total, desc="requests", unit="req") as bar:
                    for name, model, in_flight, cols in workloads:
                        def submit(i: int, model: str = model, cols: int = cols) -> Future[Any]:
                            return client.submit(model, rng.random((1, cols), np.float32))

                        results.append(run_closed_loop(name, submit, args.requests, in_flight,
                                                       on_done=lambda: bar.update(1)))
            gateway_ok = _through_gateway(http_port)
        finally:
            stop_process(up, signal.SIGINT, 60)
        left = [pid for pid in worker_pids if pid_alive(pid)]
        for pid in left:  # reported below, and not left running
            os.kill(pid, signal.SIGKILL)
    print()
    print(_table(results))
    print()
    failures = sum(r.failures for r in results) + (0 if gateway_ok else 1)
    print(f"demo: {sum(r.requests for r in results)} requests, {failures} failed; "
          f"'asyncinfer up' exited with {up.returncode}; processes left behind: {left or 'none'}")
    return 0 if failures == 0 and not left and up.returncode == 0 else 1


def _free_ports(n: int) -> list[int]:
    from asyncinfer.ops.redis_server import free_port

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _through_gateway(port: int, timeout_s: float = 60.0) -> bool:
    """One v2 REST call to ``up``'s gateway (what any KServe/Triton client sends); prints it."""
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                   "data": [0.5] * 16}]}).encode()
    url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as r:
                answer = json.loads(r.read())
            break
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                print(f"demo: the gateway did not answer at {url}: {exc}")
                return False
            time.sleep(0.5)
    output = answer["outputs"][0]
    print(f"demo: v2 gateway: POST {url} -> {output['name']} {output['datatype']}{output['shape']} "
          f"(batch {answer['parameters']['batch_size']} on {answer['parameters']['worker']})")
    return True


if __name__ == "__main__":
    sys.exit(main())
