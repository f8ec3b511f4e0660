"""Two gateway versions side by side, the load alternated between them in short slices.

    .venv/bin/python bench/gateway_ab.py --old /path/to/old/tree --new /path/to/new/tree \\
        [--workload identity] (any bench workload) [--in-flight 256] [--slices 6] [--slice-s 4] \\
        [--out results.jsonl]

``--old`` and ``--new`` are source trees of asyncinfer (``git worktree add /tmp/old REV``). One
embedded Redis and one worker (this tree's) serve both; one ``asyncinfer gateway`` runs from each
tree. The load is ``tritonclient.grpc.aio`` from this process, as the bench drives a gateway: a
closed loop of ``--in-flight`` calls for ``--slice-s`` seconds on one gateway, then on the other
(old, new, then new, old, ...), so both meet the same moments of a shared host. Each slice is one
JSON line (calls, failures, req/s, p50, the gateway's CPU ms per completed call, from its own
process tree); the medians per version close the run. A script, not a test: this machine is too
noisy for timed assertions, so compare only the slices of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from client_ab import wait_hosted  # this folder is first on sys.path when run as a script

from asyncinfer.ops.benchmark.host import tree_cpu_s
from asyncinfer.ops.benchmark.v2_loadgen import closed_loop, request_rows
from asyncinfer.ops.benchmark.workloads import WORKLOADS
from asyncinfer.ops.redis_server import RedisServer, free_port
from asyncinfer.supervision.processes import stop_process

HERE = Path(__file__).resolve().parents[1]


def _env(url: str, tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    env.update(ASYNCINFER_BROKER_URL=url, ASYNCINFER_LOG_LEVEL="warning",
               ASYNCINFER_CONCURRENCY="1", PYTHONPATH=str(tree))
    return env


def _gateway(url: str, tree: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncinfer", "gateway", "--http-port", "0", "--grpc-port", str(port),
         "--metrics-port", "0"], env=_env(url, tree), stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        cwd=tree)  # ``-m`` puts the working directory first on sys.path: it must be the tree
    deadline = time.monotonic() + 60
    while "gateway ready" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline or process.poll() is not None:
            raise SystemExit(f"the gateway of {tree} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return process, port


async def _slices(args: argparse.Namespace, gateways: dict[str, tuple[Any, int]]) -> list[dict[str, Any]]:
    import tritonclient.grpc.aio as grpcclient

    workload = WORKLOADS[args.workload]
    name, datatype, rows = request_rows(args.workload, 64)
    clients = {tag: grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
               for tag, (_, port) in gateways.items()}

    async def call(client: Any, i: int) -> int:
        row = rows[i % len(rows)]
        tensor = grpcclient.InferInput(name, list(row.shape), datatype)
        tensor.set_data_from_numpy(row)
        await client.infer(workload.model, [tensor])
        return 1  # what closed_loop counts as a batch size: not read here

    for client in clients.values():  # warm-up: first calls, and a full batch
        for i in range(40):
            await call(client, i)
        await asyncio.gather(*(call(client, i) for i in range(64)))
    records = []
    for s in range(args.slices):
        for tag in (["old", "new"] if s % 2 == 0 else ["new", "old"]):
            pid = gateways[tag][0].pid
            cpu0 = tree_cpu_s(pid)
            done = await closed_loop(lambda i, client=clients[tag]: call(client, i),
                                     args.in_flight, args.slice_s)
            cpu_s = tree_cpu_s(pid) - cpu0
            latencies = sorted(done["latencies_ms"])
            record = {"version": tag, "slice": s, "workload": args.workload,
                      "in_flight": args.in_flight, "calls": len(latencies),
                      "failures": done["failures"],
                      "req_per_s": round(len(latencies) / done["elapsed_s"], 1),
                      "p50_ms": round(latencies[len(latencies) // 2], 3) if latencies else None,
                      "gateway_cpu_ms_per_call": round(cpu_s * 1000 / max(1, len(latencies)), 4)}
            print(json.dumps(record), flush=True)
            records.append(record)
            await asyncio.sleep(0.5)
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, type=Path)
    p.add_argument("--new", required=True, type=Path)
    p.add_argument("--workload", default="identity", choices=sorted(WORKLOADS))
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--slices", type=int, default=6, help="slices per version")
    p.add_argument("--slice-s", type=float, default=4.0)
    p.add_argument("--out", type=Path, help="append each slice's line to this JSONL file too")
    args = p.parse_args()
    workload = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(Path(tmp) / "redis", appendonly=False) as redis:
        env = _env(redis.url, HERE)
        if workload.factories:
            env["ASYNCINFER_MODEL_FACTORIES"] = workload.factories
        worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                                   "--models", workload.model, "--hostname", "gateway-ab@%h"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gateways: dict[str, tuple[Any, int]] = {}
        try:
            wait_hosted(redis.url, workload.model, worker)
            for tag, tree in (("old", args.old), ("new", args.new)):
                gateways[tag] = _gateway(redis.url, tree, Path(tmp) / f"{tag}.log")
            records = asyncio.run(_slices(args, gateways))
        finally:
            for process, _ in gateways.values():
                stop_process(process, signal.SIGTERM, 30)
            stop_process(worker, signal.SIGTERM, 30)
    if args.out:
        with open(args.out, "a") as f:
            for record in records:
                f.write(json.dumps(dict(record, old=str(args.old), new=str(args.new))) + "\n")
    for tag in ("old", "new"):
        mine = [r for r in records if r["version"] == tag]
        print(f"{tag}: gateway CPU ms/call median "
              f"{statistics.median(r['gateway_cpu_ms_per_call'] for r in mine):.3f}, req/s median "
              f"{statistics.median(r['req_per_s'] for r in mine)}, failures "
              f"{sum(r['failures'] for r in mine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
