"""N workers on one queue: do they add up? Rows/s against N × the device limit, side by side.

    .venv/bin/python bench/scale_out.py [--trees old=/tmp/old,new=.] [--workers 1,4,8]
        [--seconds 20] [--out bench/results/scale_out.json] [--env ASYNCINFER_HOLD_BATCHES=3]

Each run starts one embedded Redis, N workers of one source tree (first on their ``PYTHONPATH``)
serving the model ``sim-scale`` — a simulated device of 100 ms + 1 ms per row with the GIL
released, max batch 32, so one worker's limit is 32 / 0.132 s = 242 rows/s — all on the queue
``infer.sim-scale``, and one client process (this tree's ``Client``) keeping 64 × N requests in
flight for a fixed time. Printed and saved per run: rows/s, share of N × the limit, mean device
batch, the workers' and Redis' CPU ms per request. A script, not a test: compare runs of one
sitting only.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
A_S, B_S, MAX_BATCH = 0.100, 0.001, 32
LIMIT_ROWS_PER_S = MAX_BATCH / (A_S + B_S * MAX_BATCH)


def sim_scale():  # noqa: ANN201 - a model factory (ASYNCINFER_MODEL_FACTORIES)
    from asyncinfer.ops.benchmark.synthetic import SimDevice

    model = SimDevice("sim-scale", A_S, B_S)
    return model


_LOAD = r'''
import json, sys, threading, time
import numpy as np
from asyncinfer import Client
url, level, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
client = Client(broker_url=url)
x = {"input": np.ones((1, 4), np.float32)}
for f in [client.submit("sim-scale", x) for _ in range(64)]:
    f.result(timeout=120)
print("ready", flush=True)
sys.stdin.readline()
slots = threading.Semaphore(level)
lock = threading.Lock()
done, batches, failures = [0], [], [0]
stop = time.monotonic() + seconds
def finished(f):
    with lock:
        if f.exception() is None:
            done[0] += 1
            batches.append(f.result().parameters.get("batch_size", 0))
        else:
            failures[0] += 1
    slots.release()
began = time.monotonic()
while time.monotonic() < stop:
    slots.acquire()
    client.submit("sim-scale", x).add_done_callback(finished)
for _ in range(level):
    slots.acquire()
elapsed = time.monotonic() - began
print(json.dumps({"answered": done[0], "failures": failures[0], "seconds": elapsed,
                  "mean_batch": sum(batches) / max(1, len(batches))}), flush=True)
client.close()
'''


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(tag: str, tree: Path, n: int, args: argparse.Namespace) -> dict:
    from asyncinfer.ops.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendonly=False).start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
        env.update(dict(kv.split("=", 1) for kv in args.env))
        env.update(ASYNCINFER_BROKER_URL=server.url, ASYNCINFER_LOG_LEVEL="warning",
                   ASYNCINFER_MODEL_FACTORIES="sim-scale=scale_out:sim_scale",
                   PYTHONPATH=f"{tree}{os.pathsep}{HERE}")
        workers = [subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                                     "--models", "sim-scale", "--hostname", f"w{i}@%h"],
                                    env=env, cwd=tree, stdout=subprocess.DEVNULL,
                                    stderr=open(Path(tmp) / f"w{i}.log", "wb"))
                   for i in range(n)]
        load = None
        try:
            load = subprocess.Popen([sys.executable, "-c", _LOAD, server.url, str(64 * n),
                                     str(args.seconds)], env={**env, "PYTHONPATH": str(ROOT)},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert load.stdout is not None and load.stdin is not None
            assert load.stdout.readline().strip() == "ready"
            time.sleep(2)  # every worker up and taking (the warm-up above needs only one)
            w0 = sum(_cpu_s(w.pid) for w in workers)
            redis_pid = server.process.pid
            r0 = _cpu_s(redis_pid)
            load.stdin.write("go\n")
            load.stdin.flush()
            out = json.loads(load.stdout.readline())
            answered = max(1, out["answered"])
            row = {"tree": tag, "workers": n, "rows_per_s": round(out["answered"] / out["seconds"], 1),
                   "share_of_limit": round(out["answered"] / out["seconds"] / (n * LIMIT_ROWS_PER_S), 3),
                   "mean_batch": round(out["mean_batch"], 1),
                   "worker_cpu_ms_per_req": round((sum(_cpu_s(w.pid) for w in workers) - w0) * 1e3
                                                  / answered, 3),
                   "redis_cpu_ms_per_req": round((_cpu_s(redis_pid) - r0) * 1e3 / answered, 3),
                   "failures": out["failures"]}
            print(json.dumps(row), flush=True)
            return row
        finally:
            if load is not None:
                load.kill()
                load.wait()
            for w in workers:
                w.terminate()
            for w in workers:
                try:
                    w.wait(30)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
            server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", default=f"new={ROOT}",
                   help="tag=path,... source trees of asyncinfer whose workers to start")
    p.add_argument("--workers", default="1,4,8")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--env", action="append", default=[],
                   help="VAR=VALUE for the workers (repeatable), e.g. ASYNCINFER_HOLD_BATCHES=3")
    args = p.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.trees.split(",")]
    rows = [_run(tag, tree, int(n), args) for n in args.workers.split(",") for tag, tree in trees]
    if args.out:
        args.out.write_text(json.dumps({"limit_rows_per_s_per_worker": round(LIMIT_ROWS_PER_S, 1),
                                        "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
