"""``asyncinfer bench``: one run, side by side, same machine, same Redis.

For each workload: (a) the model called in-process at its best batch size — the limit; (b) plain
Celery, one task per request; (c) asyncinfer. Closed loop at each in-flight level, then an open-
loop rate sweep. ``--systems`` also takes ``gateway`` / ``gateway-http``: asyncinfer's worker
behind ``asyncinfer gateway``, driven over gRPC / HTTP by Triton's own client (closed loop only),
and ``triton`` and ``ray``: the peers, driven the same way (closed loop only), whose servers are
scripts of a source checkout (``--peers-dir``, default ``./bench/peers``) run from a venv of their
own (``--peers-venv``, default ``./.venv-peers``: ``make peers``). Writes JSON, Markdown and a PNG
plot under ``--out`` (``./bench-results``; the project's own figures are ``--out bench/results``).
``--redis-rtt-ms 2`` puts Redis a 2 ms round trip away from the producers (a delay proxy,
ops/benchmark/latency_proxy.py): a producer in another zone than its Redis; the workers stay near it.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asyncinfer.client import Client
from asyncinfer.models.registry import Registry
from asyncinfer.ops.benchmark.latency_proxy import LatencyProxy, ping_ms
from asyncinfer.ops.benchmark.measure import Run, closed_loop, direct_call_ms, model_limit, open_loop
from asyncinfer.ops.benchmark.peer_servers import PEERS, PEERS_DIR_ENV, PEERS_VENV_ENV, Peers
from asyncinfer.ops.benchmark.report import markdown, write_report
from asyncinfer.ops.benchmark.systems import (
    GATEWAYS,
    WorkerUnderTest,
    available_systems,
    is_gateway,
    is_peer,
    measure_gateway_runs,
    measure_peer_runs,
    payload_kwargs,
    process_cpu_s,
    start_system,
)
from asyncinfer.ops.benchmark.workloads import WORKLOADS, Workload
from asyncinfer.ops.redis_server import RedisServer

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncinfer bench", description=__doc__)
    p.add_argument("--workloads",
                   default="identity,mlp,minilm,pipeline3-async,pipeline3-sync,sim-slow,sim-fast")
    p.add_argument("--systems", default="celery,asyncinfer",
                   help="of celery, asyncinfer, gateway, gateway-http, triton, ray")
    p.add_argument("--in-flight", default="1,8,64,256", help="closed-loop levels")
    p.add_argument("--rates", default="0.25,0.5,0.75,1.0",
                   help="open-loop rates as fractions of the system's best closed-loop throughput")
    p.add_argument("--duration-s", type=float, default=4.0, help="seconds per run")
    p.add_argument("--concurrency", type=int, default=64, help="worker threads / requests in flight")
    p.add_argument("--device", default="cpu")
    p.add_argument("--broker-url", help="an existing Redis (default: an embedded one)")
    p.add_argument("--redis-rtt-ms", type=float, default=0.0,
                   help="put Redis this round trip away (a delay proxy, half each way) from the "
                        "producers (the bench's Client, the gateway); 0: loopback")
    p.add_argument("--redis-rtt-for", choices=("producers", "all"), default="producers",
                   help="who talks to Redis through the delay proxy: the producers alone, or the "
                        "workers too")
    p.add_argument("--out", default="bench-results",
                   help="folder for bench.{json,md,png} (default ./bench-results; the project's "
                        "committed figures: bench/results)")
    p.add_argument("--peers-dir", help=f"the peers' servers and load generator, for triton and ray "
                   f"(default {PEERS_DIR_ENV} or ./bench/peers: a source checkout's)")
    p.add_argument("--peers-venv", help=f"the peers' venv (default {PEERS_VENV_ENV} or ./.venv-peers: "
                   f"`make peers`)")
    return p.parse_args(argv)


#: What ``--systems`` takes.
SYSTEMS = ("celery", "asyncinfer", *GATEWAYS, *PEERS)


def parse_systems(text: str) -> list[str]:
    """``--systems``: names separated by commas, each one of ``SYSTEMS`` (SystemExit otherwise)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def _available(workload: Workload) -> bool:
    registry = Registry.from_config([workload.factories] if workload.factories else [])
    return workload.model in registry.names()


def _limit(workload: Workload, duration_s: float,
           by_cost: bool = False) -> tuple[dict[int, float], float]:
    """The model's in-process limit on the workload's payloads in the load's order; ``by_cost``:
    sorted by the cost of a row first (batches of like length: what length-aware batching can
    reach)."""
    registry = Registry.from_config([workload.factories] if workload.factories else [])
    model = registry.create(workload.model)
    rates = model_limit(model, [workload.payload(i) for i in range(workload.distinct_payloads)],
                        (1, 8, 32, 64),
                        duration_s, by_cost=by_cost)
    return rates, direct_call_ms(model, workload.payload(0))


class _CpuMeter:
    """CPU seconds spent during one run by the worker, this process (the client) and Redis."""

    def __init__(self, worker: WorkerUnderTest, redis_pid: int | None) -> None:
        self.worker = worker
        self.redis_pid = redis_pid
        self._start = self._now()

    def _now(self) -> tuple[float, float, float | None]:
        redis = process_cpu_s(self.redis_pid) if self.redis_pid else None
        return self.worker.cpu_s(), time.process_time(), redis

    def charge(self, run: Run) -> Run:
        """Set ``run``'s CPU milliseconds per request since this meter started."""
        end, n = self._now(), max(1, len(run.latencies_ms))
        run.worker_cpu_ms_per_request = (end[0] - self._start[0]) * 1000 / n
        run.client_cpu_ms_per_request = (end[1] - self._start[1]) * 1000 / n
        if end[2] is not None and self._start[2] is not None:
            run.redis_cpu_ms_per_request = (end[2] - self._start[2]) * 1000 / n
        return run


def _measure(system: str, workload: Workload, client: Client, worker: WorkerUnderTest,
             levels: list[int], rates: list[float], duration_s: float, bar: tqdm,
             redis_pid: int | None = None) -> list[Run]:
    payloads = [payload_kwargs(workload, i) for i in range(64)]

    def submit(i: int) -> Any:
        return client.send(worker.task, worker.queue, payloads[i % len(payloads)])

    for i in range(20):  # warm up
        submit(i).result(timeout=120)
    runs = []
    for level in levels:
        meter = _CpuMeter(worker, redis_pid)
        run = closed_loop(Run(system, workload.name, "closed", level), submit, level, duration_s)
        runs.append(meter.charge(run))
        bar.update(1)
    best = max(r.throughput for r in runs)
    for fraction in rates:
        meter = _CpuMeter(worker, redis_pid)
        run = open_loop(Run(system, workload.name, "open", round(best * fraction, 1)), submit,
                        best * fraction, duration_s)
        runs.append(meter.charge(run))
        bar.update(1)
    return runs


def _closed(doc: dict[str, Any], workload: str, system: str, level: int) -> dict[str, Any] | None:
    for run in doc["runs"]:
        if (run["workload"], run["system"], run["mode"], int(run["level"])) == (
                workload, system, "closed", level):
            return run
    return None


def _targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []

    def add(name: str, value: float | None, goal: str, met: bool) -> None:
        if value is not None:
            out.append({"name": name, "value": value, "goal": goal, "met": met})

    mlp_a, mlp_c = _closed(doc, "mlp", "asyncinfer", 64), _closed(doc, "mlp", "celery", 64)
    if mlp_a and mlp_c:
        ratio = mlp_a["throughput_rps"] / max(mlp_c["throughput_rps"], 1e-9)
        add("mlp, 64 in flight: asyncinfer / plain Celery throughput", ratio, ">= 5", ratio >= 5)
    mini_a, mini_c = _closed(doc, "minilm", "asyncinfer", 64), _closed(doc, "minilm", "celery", 64)
    limit = max(doc["limits"].get("minilm", {0: 0}).values())
    if mini_a and limit:
        share = mini_a["throughput_rps"] / limit
        add("minilm, 64 in flight: asyncinfer / in-process limit", share, ">= 0.90", share >= 0.9)
    if mini_a and mini_c:
        ratio = mini_a["throughput_rps"] / max(mini_c["throughput_rps"], 1e-9)
        add("minilm, 64 in flight: asyncinfer / plain Celery", ratio, ">= 3", ratio >= 3)
    ident = _closed(doc, "identity", "asyncinfer", 1)
    direct = doc["direct_call_ms"].get("identity")
    if ident and direct is not None:
        p50, p99 = ident["p50_ms"] - direct, ident["p99_ms"] - direct
        add("identity, 1 in flight: p50 added latency (ms)", p50, "<= 2", p50 <= 2)
        add("identity, 1 in flight: p99 added latency (ms)", p99, "<= 5", p99 <= 5)
    out += added_latency_targets(doc)
    pa = _closed(doc, "pipeline3-async", "asyncinfer", 64)
    ps = _closed(doc, "pipeline3-sync", "asyncinfer", 64)
    if pa and ps:
        ratio = pa["throughput_rps"] / max(ps["throughput_rps"], 1e-9)
        add("balanced 3-stage pipeline, 64 in flight: async / sync", ratio, ">= 1.8", ratio >= 1.8)
    return out


#: The gateway's added latency at 1 in flight, p50 (ms): the goal.
ADDED_LATENCY_GOAL_MS = 1.0


def added_latency_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload and gateway front: its p50 at 1 in flight less the Python ``Client``'s (the
    ``asyncinfer`` system's) p50 at 1 in flight, same workload, same run."""
    out = []
    workloads = list(dict.fromkeys(r["workload"] for r in doc["runs"]))
    for workload in workloads:
        base = _closed(doc, workload, "asyncinfer", 1)
        for system, front in GATEWAYS.items():
            run = _closed(doc, workload, system, 1)
            if base and run:
                added = run["p50_ms"] - base["p50_ms"]
                out.append({"name": f"{workload}, 1 in flight: gateway ({front}) p50 − Client p50 (ms)",
                            "value": added, "goal": f"<= {ADDED_LATENCY_GOAL_MS:g}",
                            "met": added <= ADDED_LATENCY_GOAL_MS})
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the bench; print the tables; return 0."""
    args = _parse(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    workloads = [WORKLOADS[n] for n in names]
    skipped = [w.name for w in workloads if not _available(w)]
    workloads = [w for w in workloads if w.name not in skipped]
    peers = Peers.find(args.peers_dir, args.peers_venv)
    systems = available_systems(parse_systems(args.systems), peers)
    levels = [int(x) for x in args.in_flight.split(",")]
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    doc: dict[str, Any] = {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": f"{platform.node()} {platform.machine()}", "device": args.device,
                 "duration_s": args.duration_s, "concurrency": args.concurrency,
                 "skipped": skipped},
        "limits": {}, "direct_call_ms": {}, "runs": [], "targets": [],
    }
    steps = sum(len(levels) + len(rates) for w in workloads
                for s in systems if s == "asyncinfer" or not w.name.startswith("pipeline3"))
    with tempfile.TemporaryDirectory(prefix="asyncinfer-bench-") as tmp, \
            tqdm(total=steps + len(workloads), desc="bench", unit="run") as bar:
        redis = None if args.broker_url else RedisServer(Path(tmp) / "redis", appendonly=False).start()
        broker = args.broker_url or (redis.url if redis else "")
        proxy = LatencyProxy(broker, args.redis_rtt_ms).start() if args.redis_rtt_ms > 0 else None
        producers = proxy.url if proxy is not None else broker
        if proxy is not None:
            doc["meta"]["redis_rtt"] = {"asked_ms": args.redis_rtt_ms, "for": args.redis_rtt_for,
                                        "measured_ms": round(ping_ms(producers), 3),
                                        "loopback_ms": round(ping_ms(broker), 3)}
            if args.redis_rtt_for == "all":
                broker = producers
        client = Client(broker_url=producers)
        try:
            for workload in workloads:
                bar.set_postfix_str(f"{workload.name}: in-process limit")
                if not workload.name.startswith("pipeline3"):
                    rates_by_size, direct = _limit(workload, min(args.duration_s, 2.0))
                    doc["limits"][workload.name] = {str(k): round(v, 1) for k, v in rates_by_size.items()}
                    doc["direct_call_ms"][workload.name] = round(direct, 4)
                    if workload.kind == "mixed-sentence":  # and batched by length, in-process
                        sorted_rates, _ = _limit(workload, min(args.duration_s, 2.0), by_cost=True)
                        doc["limits"][f"{workload.name} (sorted by length)"] = {
                            str(k): round(v, 1) for k, v in sorted_rates.items()}
                bar.update(1)
                for system in systems:
                    if system != "asyncinfer" and workload.name.startswith("pipeline3"):
                        continue  # the pipelined/serial comparison is asyncinfer's own
                    bar.set_postfix_str(f"{workload.name}: {system}")
                    if is_peer(system):  # closed loop only: its own load generator, its own venv
                        runs = measure_peer_runs(system, workload, levels, args.duration_s, Path(tmp),
                                                 peers)
                        doc["runs"] += [r.summary() for r in runs]
                        bar.update(len(levels) + len(rates))
                        continue
                    worker = start_system(system, workload, broker, Path(tmp), args.concurrency,
                                          args.device)
                    redis_pid = redis.process.pid if redis and redis.process else None
                    try:
                        worker.wait_ready(client.app)
                        if is_gateway(system):  # closed loop only, as the peers
                            runs = measure_gateway_runs(system, workload, worker, producers, levels,
                                                        args.duration_s, Path(tmp), redis_pid)
                            doc["runs"] += [r.summary() for r in runs]
                            bar.update(len(levels) + len(rates))
                            continue
                        runs = _measure(system, workload, client, worker, levels, rates,
                                        args.duration_s, bar, redis_pid)
                        doc["runs"] += [r.summary() for r in runs]
                    finally:
                        worker.stop()
                        time.sleep(0.5)
        finally:
            client.close()
            if proxy is not None:
                proxy.stop()
            if redis is not None:
                redis.stop()
    doc["targets"] = _targets(doc)
    written = write_report(doc, Path(args.out))
    print(markdown(doc))
    print("\nwritten: " + ", ".join(str(p) for p in written))
    return 0
