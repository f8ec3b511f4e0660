"""Two worker versions under the same load, alternated: where a worker-side change moves the work.

    .venv/bin/python bench/worker_ab.py --old /path/to/old/tree --new /path/to/new/tree \\
        [--pairs 3] [--model sim-fast] (any bench workload) [--in-flight 256] [--requests 20000]
    .venv/bin/python bench/worker_ab.py --tree a=/tree/a --tree b=/tree/b --tree c=/tree/c \\
        --client own ...
    .venv/bin/python bench/worker_ab.py --tree old=/tree/old --tree new=/tree/new \\
        --consumer celery --consumer amqp ...

``--old`` and ``--new`` (or ``--tree TAG=PATH``, two or more, taken in turn) are source trees of
asyncinfer (``git worktree add /tmp/old REV``); each run starts a fresh worker from one of them
(first on its ``PYTHONPATH``) against one embedded Redis, and drives it in a process of its own
with this tree's client, or with the run's own tree's client (``--client own``: the whole serving
path of each tree, side by side). Each run prints
one JSON line: throughput, p50/p99, mean device batch, CPU ms per request of the worker, the
client and Redis, and the worker's threads' CPU ms per request, largest first (named when py-spy
is installed). ``--consumer`` (repeatable) picks what feeds the worker's pipeline: ``fast`` (the
default: the take script on Redis), ``celery`` (Celery's consumer on Redis,
``ASYNCINFER_CONSUMER=celery``) or ``amqp`` (a RabbitMQ broker, ``--amqp-url``, results on the
embedded Redis); each tree runs with each. A script, not a test: this machine is too noisy for
timed assertions, so compare only runs of the same sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client_ab import wait_hosted  # this folder is first on sys.path when run as a script

from asyncinfer.ops.benchmark.workloads import WORKLOADS

_LOAD = r'''
import json, sys, time
import redis
from asyncinfer import Client
try:
    from asyncinfer.ops.benchmark.loadgen import percentile, run_closed_loop
    from asyncinfer.ops.benchmark.systems import process_cpu_s
    from asyncinfer.ops.benchmark.workloads import WORKLOADS
except ImportError:  # a tree from before the benchmark moved under ops/
    from asyncinfer.bench.loadgen import percentile, run_closed_loop
    from asyncinfer.bench.systems import process_cpu_s
    from asyncinfer.bench.workloads import WORKLOADS
from asyncinfer.constants import TASK_NAME, queue_for

url, worker_pid, redis_pid, workload, level, total, broker = sys.argv[1:8]
worker_pid, redis_pid, level, total = int(worker_pid), int(redis_pid), int(level), int(total)
client = Client(broker_url=broker, result_backend=url)
model = WORKLOADS[workload].model
payloads = [{"model": model, **WORKLOADS[workload].payload(i)}
            for i in range(WORKLOADS[workload].distinct_payloads)]
submit = lambda i: client.send(TASK_NAME, queue_for(model), payloads[i % len(payloads)])
for f in [submit(i) for i in range(300)]:
    f.result(timeout=60)
print("ready", flush=True)
sys.stdin.readline()  # the thread counts are read now
stats = redis.Redis.from_url(url)
calls = lambda: {k: v["calls"] for k, v in stats.info("commandstats").items()}
usec = lambda: {k: v["usec"] for k, v in stats.info("commandstats").items()}
s0, u0 = calls(), usec()
c0, w0, r0 = time.process_time(), process_cpu_s(worker_pid), process_cpu_s(redis_pid)
res = run_closed_loop("ab", submit, total, level)
n = max(1, len(res.latencies_ms))
s1, u1 = calls(), usec()
sizes = res.batch_sizes
print(json.dumps({
    "req_per_s": round(res.throughput, 1), "p50_ms": round(percentile(res.latencies_ms, 50), 2),
    "p99_ms": round(percentile(res.latencies_ms, 99), 2),
    "mean_batch": round(sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values())), 1),
    "cpu_ms_per_request": {"worker": round((process_cpu_s(worker_pid) - w0) * 1e3 / n, 3),
                           "client": round((time.process_time() - c0) * 1e3 / n, 3),
                           "redis": round((process_cpu_s(redis_pid) - r0) * 1e3 / n, 3)},
    "redis_commands_per_request": round((sum(s1.values()) - sum(s0.values())) / n, 2),
    "redis_commands": {k.removeprefix("cmdstat_"): round((s1[k] - s0.get(k, 0)) / n, 2)
                       for k in s1 if (s1[k] - s0.get(k, 0)) / n >= 0.05},
    "redis_usec_per_request": {k.removeprefix("cmdstat_"): round((u1[k] - u0.get(k, 0)) / n, 2)
                               for k in u1 if (u1[k] - u0.get(k, 0)) / n >= 0.05},
    "requests": n, "failures": res.failures}), flush=True)
client.close()
'''

def _thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _thread_names(pid: int) -> dict[int, str]:
    """Python thread names by native thread ID, from ``py-spy dump`` when it is installed."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return {}
    dump = subprocess.run([spy, "dump", "--nonblocking", "-p", str(pid)], capture_output=True,
                          text=True, check=False).stdout
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r'Thread (\d+) \(\w[\w+]*\): "([^"]+)"', dump)}


_WORKLOAD = r'''
import json, sys
try:
    from asyncinfer.ops.benchmark.workloads import WORKLOADS
except ImportError:  # a tree from before the benchmark moved under ops/
    from asyncinfer.bench.workloads import WORKLOADS
w = WORKLOADS[sys.argv[1]]
print(json.dumps([w.factories, w.options]))
'''


def _tree_workload(tree: Path, model: str) -> tuple[str, dict]:
    """The workload's model factories and options as ``tree`` names them (its modules' paths)."""
    out = subprocess.run([sys.executable, "-c", _WORKLOAD, model], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree).stdout
    factories, options = json.loads(out)
    return factories, options


def _run(tag: str, tree: Path, url: str, redis_pid: int, args: argparse.Namespace,
         env: dict[str, str], log_dir: Path, consumer: str = "fast") -> None:
    broker = args.amqp_url if consumer == "amqp" else url
    env = {**env, "ASYNCINFER_BROKER_URL": broker, "ASYNCINFER_RESULT_BACKEND": url,
           "ASYNCINFER_CONSUMER": "celery" if consumer == "celery" else "fast"}
    worker_env = {**env, "PYTHONPATH": str(tree)}
    workload = WORKLOADS[args.model]
    factories, options = _tree_workload(tree, args.model)
    if factories:
        worker_env["ASYNCINFER_MODEL_FACTORIES"] = factories
    if options:
        worker_env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({workload.model: options})
    with open(log_dir / f"worker-{tag}.log", "ab") as log:
        worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                                   "--models", workload.model, "--hostname", f"ab-{tag}@%h"],
                                  env=worker_env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    try:
        wait_hosted(url, workload.model, worker)
        client_tree = tree if args.client == "own" else Path(__file__).resolve().parents[1]
        load = subprocess.Popen([sys.executable, "-c", _LOAD, url, str(worker.pid), str(redis_pid),
                                 args.model, str(args.in_flight), str(args.requests), broker],
                                env={**env, "PYTHONPATH": str(client_tree)},
                                cwd=client_tree,  # ``-c`` puts its cwd first on sys.path
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert load.stdin is not None and load.stdout is not None
        load.stdout.readline()  # ready
        before = _thread_cpu_s(worker.pid)
        load.stdin.write("go\n")
        load.stdin.flush()
        time.sleep(2)
        names = _thread_names(worker.pid)
        line = load.stdout.readline()
        after = _thread_cpu_s(worker.pid)
        load.wait(60)
        result = json.loads(line)
        n = result["requests"]
        threads = sorted(((after[t] - before.get(t, 0.0)) * 1e3 / n, names.get(t, str(t)))
                         for t in after)
        result["worker_threads_cpu_ms_per_request"] = {name: round(ms, 3)
                                                        for ms, name in reversed(threads) if ms >= 0.005}
        print(json.dumps({"worker": tag, "consumer": consumer, **result}), flush=True)
    finally:
        worker.terminate()
        worker.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path)
    p.add_argument("--new", type=Path)
    p.add_argument("--tree", action="append", default=[], metavar="TAG=PATH",
                   help="a tree to run, in turn with the others (instead of --old and --new)")
    p.add_argument("--client", choices=("this", "own"), default="this",
                   help="the load's client: this tree's (default), or each run's own tree's")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--model", default="sim-fast", choices=sorted(WORKLOADS))
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--consumer", action="append", choices=("fast", "celery", "amqp"),
                   help="what feeds the worker (repeatable; default: fast)")
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//",
                   help="the RabbitMQ of --consumer amqp")
    args = p.parse_args()
    trees = [(tag, Path(path)) for tag, _, path in (t.partition("=") for t in args.tree)]
    if not trees:
        if args.old is None or args.new is None:
            p.error("give --old and --new, or two or more --tree TAG=PATH")
        trees = [("old", args.old), ("new", args.new)]
    from asyncinfer.ops.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis", appendonly=False).start()
        assert server.process is not None
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")},
               "ASYNCINFER_BROKER_URL": server.url, "ASYNCINFER_LOG_LEVEL": "warning"}
        try:
            for _ in range(args.pairs):
                for consumer in args.consumer or ["fast"]:
                    for tag, tree in trees:
                        _run(tag, tree.resolve(), server.url, server.process.pid, args, env,
                             Path(tmp), consumer)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
