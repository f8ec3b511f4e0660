"""Where one Redis stops: a fleet of simulated-device workers and several producers on one Redis.

    .venv/bin/python bench/fleet_sim.py                  # the whole sweep: ~6 min on 2 quiet cores
    .venv/bin/python bench/fleet_sim.py --quick          # ~1 min
        [--workers 1,2,4,8] [--producers 1,2,4] [--batches 1,8,32] [--seconds 4]
        [--device sim-slow|sim-fast] [--appendonly] [--env VAR=VALUE] [--out FILE]

One real ``redis-server`` (the embedded one, as ``asyncinfer bench`` starts it), ``asyncinfer
worker`` processes serving one of the bench's simulated devices (``sim-slow`` by default: 20 ms
+ 1 ms per row with the GIL released, so a worker costs the host its serving path only and its
batches fill) with ``max_batch_size`` set to each batch size in turn, and producer processes,
each one ``Client`` keeping its share of the requests in flight (closed loop, the bench's own
:func:`~asyncinfer.ops.benchmark.measure.closed_loop`).

For each batch size one Redis is started, with one worker; workers are added (1, 2, 4, 8) and at
each count the fleet is first measured idle (what Redis spends on workers that wait), then under
each number of producers (the same requests in flight in all, shared among them). Each point
records: requests/s answered, the mean device batch, Redis' CPU per request (``INFO cpu`` deltas,
process and main thread; the main thread is what saturates), Redis' commands per request by
command (``INFO commandstats`` deltas: a script's inner commands are counted under their own
names too, and its time includes theirs), bytes in and out per request, the workers' and
producers' CPU per request (/proc), the CPU that processes outside the simulation took meanwhile
and the host's load average. From Redis' main-thread CPU per request follows what one Redis core
carries: ``1 / cpu per request`` requests/s; a line ``a + b / rows per batch`` through every
point splits it into what each request and each device batch costs. One more point per batch
size logs every command (bench/fleet_meter.py) to say which script Redis' time goes to.

The throughput of a point is what this host's cores allow (workers, producers and Redis share
them); the CPU per request is the figure that carries over to a bigger host. Every process is
stopped by its PID. A script, not a test: compare the points of one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

from fleet_meter import CommandLog, Meter

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "fleet_sim_2026-12-03.json"
#: The bench workloads whose simulated device the workers serve (asyncinfer.ops.benchmark.synthetic).
DEVICES = ("sim-slow", "sim-fast")


class Producer:
    """A producer process (this script with ``--producer``): one ``Client``, told when to load."""

    def __init__(self, url: str, workload: str, env: dict[str, str], log_path: Path) -> None:
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen([sys.executable, __file__, "--producer", url, "--device",
                                         workload], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        line = self._line(timeout_s)
        if line != "ready":
            raise RuntimeError(f"producer {self.process.pid} said {line!r}")

    def go(self, in_flight: int, seconds: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{in_flight} {seconds}\n")
        self.process.stdin.flush()

    def outcome(self, timeout_s: float) -> dict[str, Any]:
        return dict(json.loads(self._line(timeout_s)))

    def _line(self, timeout_s: float) -> str:
        import select

        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"producer {self.process.pid} said nothing in {timeout_s} s "
                               f"(exit {self.process.poll()}); see {self._log.name}")
        return line.strip()

    def stop(self) -> None:
        from asyncinfer.supervision.processes import stop_process

        stop_process(self.process, signal.SIGTERM, 10)  # type: ignore[arg-type]
        self._log.close()


def produce(url: str, name: str) -> int:
    """The producer process: warm up, say ready, then per line ``IN_FLIGHT SECONDS`` on stdin run
    a closed loop and print its outcome as one JSON line."""
    from asyncinfer import Client
    from asyncinfer.constants import TASK_NAME, queue_for
    from asyncinfer.ops.benchmark.measure import Run, closed_loop
    from asyncinfer.ops.benchmark.systems import payload_kwargs
    from asyncinfer.ops.benchmark.workloads import WORKLOADS

    workload = WORKLOADS[name]
    payloads = [payload_kwargs(workload, i) for i in range(64)]
    queue = queue_for(workload.model)
    with Client(broker_url=url) as client:
        def submit(i: int) -> Any:
            return client.send(TASK_NAME, queue, payloads[i % len(payloads)])

        for i in range(20):
            submit(i).result(timeout=120)
        print("ready", flush=True)
        for line in sys.stdin:
            in_flight, seconds = line.split()
            cpu0 = time.process_time()
            run = closed_loop(Run("asyncinfer", name, "closed", int(in_flight)), submit,
                              int(in_flight), float(seconds))
            print(json.dumps({"answered": len(run.latencies_ms), "failures": run.failures,
                              "elapsed_s": run.elapsed_s, "p50_ms": run.summary()["p50_ms"],
                              "batch_sizes": dict(run.batch_sizes),
                              "cpu_s": time.process_time() - cpu0}), flush=True)
    return 0


def _env(url: str, name: str, batch: int, extra: list[str]) -> dict[str, str]:
    """The workers' and producers' environment: the broker, the device's max batch, ``extra``
    (``VAR=VALUE`` each), and this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    from asyncinfer.ops.benchmark.workloads import WORKLOADS

    workload = WORKLOADS[name]
    env.update(ASYNCINFER_BROKER_URL=url, ASYNCINFER_LOG_LEVEL="warning",
               ASYNCINFER_MODEL_FACTORIES=workload.factories,
               ASYNCINFER_MODEL_OPTIONS=json.dumps({workload.model: {"max_batch_size": batch}}),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(dict(kv.split("=", 1) for kv in extra))
    return env


def _mean_batches(counts: Counter[int]) -> tuple[float, float]:
    """Mean batch a request rode in, and mean rows per device batch."""
    requests = sum(counts.values())
    if not requests:
        return 0.0, 0.0
    batches = sum(n / size for size, n in counts.items() if size)
    return sum(size * n for size, n in counts.items()) / requests, requests / max(batches, 1e-9)


def _load_point(producers: list[Producer], meter_args: tuple[Any, ...], in_flight: int,
                seconds: float) -> dict[str, Any]:
    """One closed-loop point: ``in_flight`` shared among ``producers``, for ``seconds``."""
    share = [in_flight // len(producers) + (1 if i < in_flight % len(producers) else 0)
             for i in range(len(producers))]
    meter = Meter(*meter_args)
    for p, n in zip(producers, share, strict=True):
        p.go(n, seconds)
    outcomes = [p.outcome(seconds + 120) for p in producers]
    answered = sum(o["answered"] for o in outcomes)
    figures = meter.delta(answered)
    counts: Counter[int] = Counter()
    for o in outcomes:
        counts.update({int(k): v for k, v in o["batch_sizes"].items()})
    per_request, per_batch = _mean_batches(counts)
    elapsed = max(o["elapsed_s"] for o in outcomes)
    main = figures["redis_main_cpu_ms_per_request"] or figures["redis_cpu_ms_per_request"]
    return {"in_flight": in_flight, "answered": answered,
            "failures": sum(o["failures"] for o in outcomes),
            "requests_per_s": round(answered / elapsed, 1),
            "mean_batch_per_request": round(per_request, 2), "mean_rows_per_batch": round(per_batch, 2),
            "p50_ms": median(o["p50_ms"] for o in outcomes),
            "redis_core_requests_per_s": round(1e3 / main) if main else None,
            **figures}


def _start_worker(i: int, name: str, env: dict[str, str], log_dir: Path) -> Any:
    from asyncinfer.constants import TASK_NAME, queue_for
    from asyncinfer.ops.benchmark.systems import WorkerUnderTest
    from asyncinfer.ops.benchmark.workloads import WORKLOADS

    hostname = f"fleet{i}@{socket.gethostname()}"
    model = WORKLOADS[name].model
    argv = [sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu", "--models", model,
            "--hostname", hostname]
    return WorkerUnderTest("asyncinfer", argv, env, log_dir / f"worker{i}.log", hostname, TASK_NAME,
                           queue_for(model))


def _attribution(producers: list[Producer], meter_args: tuple[Any, ...], in_flight: int,
                 seconds: float, idle_s: float) -> dict[str, Any]:
    """Every command logged (bench/fleet_meter.py) through one more point, and through an idle
    spell after it: Redis' time per request, and per second of an idle fleet, by script and
    command. The log's own cost makes these no CPU figures."""
    with CommandLog(meter_args[0]) as log:
        row = _load_point(producers, meter_args, in_flight, seconds)
    time.sleep(1.0)  # the fleet idle again
    with CommandLog(meter_args[0]) as idle_log:
        time.sleep(idle_s)
    idle = idle_log.per_request(1)
    return {"requests_per_s": row["requests_per_s"], "mean_rows_per_batch": row["mean_rows_per_batch"],
            "redis_cpu_ms_per_request_while_logged": row["redis_cpu_ms_per_request"],
            **log.per_request(row["answered"]),
            "idle_per_s": {"executed_usec": round(idle["executed_usec"] / idle_s, 1),
                           "sent_by_clients": {k: {"calls": round(v["calls"] / idle_s, 2),
                                                   "usec": round(v["usec"] / idle_s, 1)}
                                               for k, v in idle["sent_by_clients"].items()}}}


class _Cluster:
    """A local Redis Cluster (tests/support/redis_cluster.py) in the shape of a RedisServer: its
    ``rediscluster://`` URL, and the process and a plain client of the master of the fleet's shard."""

    def __init__(self, folder: Path, binary: str) -> None:
        from asyncinfer.broker.shards import shard_tags, tag_slot
        from tests.support.redis_cluster import LocalCluster

        self.cluster = LocalCluster(folder, binary=binary).start()
        self.url = self.cluster.fleet_url()
        self.master = self.cluster.master_of_slot(tag_slot(shard_tags(1)[0]))
        self.process = self.master.process
        for node in self.cluster.masters():  # as the embedded Redis keeps them (redis_server.py)
            with node.client() as c:
                c.config_set("zset-max-ziplist-entries", 0)
                c.config_set("hash-max-ziplist-entries", 0)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.master.port)

    def stop(self) -> None:
        self.cluster.stop()


def _fleet(batch: int, args: argparse.Namespace,
           log_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every point of one batch size (one Redis, workers added step by step), and where Redis'
    time goes at the last one (:func:`_attribution`)."""
    import redis

    from asyncinfer import Client
    from asyncinfer.ops.redis_server import RedisServer, redis_server_binary

    points: list[dict[str, Any]] = []
    attribution: dict[str, Any] = {}
    server: Any
    if args.cluster:  # the figures are those of the shard's master
        server = _Cluster(log_dir / f"cluster-{batch}",
                          redis_server_binary(prefer_system=args.system_redis))
    else:
        server = RedisServer(log_dir / f"redis-{batch}", appendonly=args.appendonly,
                             die_with_parent=True,
                             binary=redis_server_binary(prefer_system=args.system_redis)).start()
    workers: list[Any] = []
    producers: list[Producer] = []
    try:
        assert server.process is not None
        env = _env(server.url, args.device, batch, args.env)
        info = server.client() if args.cluster else redis.Redis.from_url(server.url)
        version = info.info("server")["redis_version"]
        with Client(broker_url=server.url) as control:
            for n in args.workers:
                started = [_start_worker(i, args.device, env, log_dir) for i in range(len(workers), n)]
                workers += started
                for w in started:
                    w.wait_ready(control.app)
                if not producers:
                    producers = [Producer(server.url, args.device, env, log_dir / f"producer{i}-{batch}.log")
                                 for i in range(max(args.producers))]
                    for p in producers:
                        p.wait_ready()
                time.sleep(args.settle_s)  # every worker past its first takes and announcements
                meter_args = (info, server.process.pid, [w.process.pid for w in workers],
                              [p.process.pid for p in producers])
                meter = Meter(*meter_args)
                time.sleep(args.idle_s)
                idle = meter.delta(0)
                base = {"max_batch": batch, "workers": n, "redis_version": version,
                        "appendonly": args.appendonly, "env": args.env}
                points.append({**base, "producers": 0, "idle": True, **idle})
                _print(points[-1])
                for p in args.producers:
                    in_flight = min(args.max_in_flight, max(64, 4 * batch * n))
                    row = _load_point(producers[:p], meter_args, in_flight, args.seconds)
                    points.append({**base, "producers": p, "idle": False, **row})
                    _print(points[-1])
            attribution = _attribution(producers, meter_args, in_flight, args.seconds, args.idle_s)
            attribution.update(max_batch=batch, workers=n, producers=len(producers))
        info.close()
    finally:
        for p in producers:
            p.stop()
        for w in workers:
            w.stop()
        server.stop()
    return points, attribution


_COLUMNS = [("max_batch", "batch", 5), ("workers", "wrk", 3), ("producers", "prod", 4),
            ("in_flight", "infl", 4), ("requests_per_s", "req/s", 7),
            ("mean_rows_per_batch", "rows/b", 6), ("redis_cpu_ms_per_request", "redis ms", 8),
            ("redis_main_cpu_ms_per_request", "main ms", 7),
            ("redis_core_requests_per_s", "req/s/core", 10), ("commands_per_request", "cmd/req", 7),
            ("worker_cpu_ms_per_request", "wrk ms", 6), ("producer_cpu_ms_per_request", "prod ms", 7),
            ("redis_cpu_share_of_core", "redis%c", 7), ("others_cpu_cores", "others", 6)]


def _print(point: dict[str, Any]) -> None:
    if point["idle"]:
        top = ", ".join(f"{k} {v['calls']:.1f}/s" for k, v in
                        list(point["top_commands_per_s"].items())[:4])
        print(f"batch {point['max_batch']:>2} workers {point['workers']}: idle Redis "
              f"{point['redis_cpu_ms_per_s']:.2f} ms CPU/s, {point['commands_per_s']:.0f} commands/s "
              f"({top}); load {point['loadavg_end'][0]}", flush=True)
        return
    if not getattr(_print, "header", False):
        print(" ".join(f"{title:>{width}}" for _, title, width in _COLUMNS), flush=True)
        _print.header = True  # type: ignore[attr-defined]
    cells = []
    for key, _, width in _COLUMNS:
        value = point.get(key)
        cells.append(f"{'-' if value is None else value:>{width}}")
    print(" ".join(cells), flush=True)


def derive(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size: the median Redis main-thread CPU per request over the loaded points, the
    requests/s one Redis core carries at that cost, and the commands that cost the most."""
    out: dict[str, Any] = {}
    for batch in sorted({p["max_batch"] for p in points}):
        loaded = [p for p in points if p["max_batch"] == batch and not p["idle"]]
        idle = [p for p in points if p["max_batch"] == batch and p["idle"]]
        main = [p["redis_main_cpu_ms_per_request"] or p["redis_cpu_ms_per_request"] for p in loaded]
        if not main:
            continue
        usec: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        for p in loaded:
            for name, v in p["top_commands_per_request"].items():
                usec[name] += v["usec"] / len(loaded)
                calls[name] += v["calls"] / len(loaded)
        out[str(batch)] = {
            "points": len(loaded),
            "mean_rows_per_batch": round(median(p["mean_rows_per_batch"] for p in loaded), 2),
            "redis_main_cpu_ms_per_request_median": round(median(main), 4),
            "redis_main_cpu_ms_per_request_range": [round(min(main), 4), round(max(main), 4)],
            "requests_per_s_per_redis_core": round(1e3 / median(main)),
            "commands_per_request_median": round(median(p["commands_per_request"] for p in loaded), 2),
            "top_commands_per_request_mean": {
                name: {"calls": round(calls[name], 3), "usec": round(usec[name], 2)}
                for name, _ in usec.most_common(8)},
            "idle_redis_cpu_ms_per_s": {p["workers"]: p["redis_cpu_ms_per_s"] for p in idle},
            "idle_commands_per_s": {p["workers"]: p["commands_per_s"] for p in idle},
        }
    return {"by_max_batch": out, **_fits(points)}


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _fits(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Redis CPU per request as ``a + b / rows per batch`` over every loaded point (a: what each
    request costs, b: what each device batch costs, its take and its store), what one Redis core
    carries at each batch size by that line, and what one idle worker costs Redis (the slope of
    idle CPU/s over the worker count)."""
    loaded = [p for p in points if not p["idle"] and p["mean_rows_per_batch"] > 0]
    idle = [p for p in points if p["idle"]]
    out: dict[str, Any] = {}
    if len({round(p["mean_rows_per_batch"], 1) for p in loaded}) > 1:
        a, b = _line([1 / p["mean_rows_per_batch"] for p in loaded],
                     [p["redis_main_cpu_ms_per_request"] or p["redis_cpu_ms_per_request"]
                      for p in loaded])
        out["redis_ms_per_request_fit"] = {"per_request_ms": round(a, 4), "per_batch_ms": round(b, 4)}
        out["requests_per_s_per_redis_core_by_rows_per_batch"] = {
            rows: round(1e3 / (a + b / rows)) for rows in (1, 2, 4, 8, 16, 32) if a + b / rows > 0}
    if len({p["workers"] for p in idle}) > 1:
        _, slope = _line([p["workers"] for p in idle], [p["redis_cpu_ms_per_s"] for p in idle])
        _, calls = _line([p["workers"] for p in idle], [p["commands_per_s"] for p in idle])
        out["idle_worker"] = {"redis_cpu_ms_per_s": round(slope, 3), "commands_per_s": round(calls, 1),
                              "idle_workers_per_redis_core": round(1e3 / slope) if slope > 0 else None}
    return out


def _device_text(name: str) -> str:
    from asyncinfer.ops.benchmark import synthetic

    device = getattr(synthetic, name.replace("-", "_"))()
    return (f"{name}: {device.a_s * 1e3:g} ms + {device.b_s * 1e3:g} ms per row, the GIL released "
            f"(asyncinfer.ops.benchmark.synthetic)")


def _host() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "cpu_model": model, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="about a minute: 2 workers, 2 producers, batches 1 and 32, 4 s a point")
    p.add_argument("--workers", default="1,2,4,8", help="worker counts, increasing")
    p.add_argument("--producers", default="1,2,4", help="producer process counts")
    p.add_argument("--batches", default="1,8,32", help="the device's max batch sizes")
    p.add_argument("--seconds", type=float, default=4.0, help="load per point")
    p.add_argument("--idle-s", type=float, default=2.0, help="idle measurement per worker count")
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--max-in-flight", type=int, default=1024,
                   help="requests in flight at most (else 4 x batch x workers, at least 64)")
    p.add_argument("--device", choices=DEVICES, default=DEVICES[0],
                   help="the simulated device: sim-slow (20 ms + 1 ms per row: batches fill) or "
                        "sim-fast (4 ms + 0.1 ms per row: the host's CPU decides the batch)")
    p.add_argument("--appendonly", action="store_true",
                   help="Redis with its append-only file (asyncinfer up's embedded broker)")
    p.add_argument("--system-redis", action="store_true", help="the system's redis-server binary")
    p.add_argument("--cluster", action="store_true",
                   help="a local Redis Cluster (3 masters, a replica each) through a rediscluster:// "
                        "URL: the figures are those of the master that owns the fleet's shard")
    p.add_argument("--env", action="append", default=[], metavar="VAR=VALUE",
                   help="for the workers and producers (repeatable), e.g. ASYNCINFER_LOST_AFTER_S=0")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--producer", metavar="URL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.producers, args.batches = "2", "2", "1,32"
    for name in ("workers", "producers", "batches"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",")])
    if args.workers != sorted(set(args.workers)):
        p.error("--workers must increase (workers are added, never removed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sys.path.insert(0, str(ROOT))  # this checkout's package, whatever the venv has installed
    if args.producer:
        return produce(args.producer, args.device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop everything
    host, began = _host(), time.monotonic()
    points: list[dict[str, Any]] = []
    attribution: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fleet-sim-") as tmp:
        for batch in args.batches:
            fleet_points, where = _fleet(batch, args, Path(tmp))
            points += fleet_points
            attribution.append(where)
    doc: dict[str, Any] = {"script": "bench/fleet_sim.py", "argv": sys.argv[1:], "workload": args.device,
           "device": _device_text(args.device),
           "host": host, "host_loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "wall_s": round(time.monotonic() - began, 1), "derived": derive(points),
           "attribution": attribution, "points": points}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("\nper batch size (Redis main-thread CPU per request -> requests/s per Redis core):")
    for batch, d in doc["derived"]["by_max_batch"].items():
        top = ", ".join(f"{k} {v['calls']:.2f}x {v['usec']:.1f}us" for k, v in
                        list(d["top_commands_per_request_mean"].items())[:5])
        print(f"  max batch {batch:>2} (rows/batch {d['mean_rows_per_batch']}): "
              f"{d['redis_main_cpu_ms_per_request_median']} ms -> "
              f"{d['requests_per_s_per_redis_core']} req/s per core; {top}")
    for key in ("redis_ms_per_request_fit", "requests_per_s_per_redis_core_by_rows_per_batch",
                "idle_worker"):
        if key in doc["derived"]:
            print(f"  {key}: {doc['derived'][key]}")
    for where in attribution:
        top = ", ".join(f"{k} {v['calls']:.2f}x {v['usec']:.1f}us" for k, v in
                        list(where["sent_by_clients"].items())[:5])
        print(f"  logged, max batch {where['max_batch']:>2} (rows/batch {where['mean_rows_per_batch']}): "
              f"{where['executed_usec']} us run per request: {top}")
    print(f"wrote {args.out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
