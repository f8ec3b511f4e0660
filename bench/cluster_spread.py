"""One model's fleet on a local Redis Cluster: its requests on one master (a URL of one shard)
against its requests spread over the three (``&shards=3``), in one sitting.

For each point: the fleet's requests/s, and per master its CPU per request, its share of a core,
its commands per request and the requests whose results it holds. ``--redis-cpu-share`` caps each
master at that share of a core (a cgroup of the ``cpu`` controller, v1), so that Redis, not the
two cores' workers and producers, is what limits the fleet: the ratio spread / one master is then
what a second and third master buy one model.

    python bench/cluster_spread.py --workers 2 --producers 2 --seconds 10 \\
        --redis-cpu-share 0.1 --repeat 2 --out bench/results/cluster_spread_2026-12-07.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fleet_meter import redis_figures
from fleet_sim import DEVICES, ROOT, Producer, _env, _mean_batches, _start_worker

sys.path.insert(0, str(ROOT))

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def cap_cpu(pid: int, share: float) -> Path | None:
    """Put process ``pid`` in a cgroup of its own limited to ``share`` of a core; its folder
    (None: no cgroup v1 ``cpu`` controller to write to)."""
    if not (CGROUP_CPU / "cgroup.procs").exists():
        return None
    folder = CGROUP_CPU / f"asyncinfer-bench-{pid}"
    folder.mkdir(exist_ok=True)
    (folder / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (folder / "cpu.cfs_quota_us").write_text(str(int(share * PERIOD_US)))
    (folder / "cgroup.procs").write_text(str(pid))
    return folder


def uncap(folder: Path | None) -> None:
    if folder is None:
        return
    for pid in (folder / "cgroup.procs").read_text().split():
        (CGROUP_CPU / "cgroup.procs").write_text(pid)
    folder.rmdir()


def _results_per_master(masters: list[Any]) -> dict[int, int]:
    out = {}
    for m in masters:
        with m.client() as c:
            out[m.port] = sum(1 for _ in c.scan_iter(match="*celery-task-meta-*", count=5000))
    return out


def point(cluster: Any, url: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One closed-loop point of ``args.workers`` workers and ``args.producers`` producers on
    ``url``; the fleet's and each master's figures."""
    from asyncinfer import Client

    masters = cluster.masters()
    for m in masters:
        with m.client() as c:
            c.flushall()
    env = _env(url, args.device, args.batch, [])
    workers, producers = [], []
    try:
        with Client(broker_url=url) as control:
            for i in range(args.workers):
                workers.append(_start_worker(i, args.device, env, log_dir))
            for w in workers:
                w.wait_ready(control.app)
        producers = [Producer(url, args.device, env, log_dir / f"producer{i}.log")
                     for i in range(args.producers)]
        for p in producers:
            p.wait_ready()
        time.sleep(1.0)
        clients = {m.port: m.client() for m in masters}
        before = {m.port: redis_figures(clients[m.port], m.process.pid) for m in masters}
        results_before = _results_per_master(masters)
        started = time.monotonic()
        share = [args.in_flight // len(producers) + (1 if i < args.in_flight % len(producers) else 0)
                 for i in range(len(producers))]
        for p, n in zip(producers, share, strict=True):
            p.go(n, args.seconds)
        outcomes = [p.outcome(args.seconds + 120) for p in producers]
        seconds = time.monotonic() - started
        after = {m.port: redis_figures(clients[m.port], m.process.pid) for m in masters}
        results = _results_per_master(masters)
        for c in clients.values():
            c.close()
    finally:
        for p in producers:
            p.stop()
        for w in workers:
            w.stop()
    answered = sum(o["answered"] for o in outcomes)
    counts: Counter[int] = Counter()
    for o in outcomes:
        counts.update({int(k): v for k, v in o["batch_sizes"].items()})
    _, rows = _mean_batches(counts)
    elapsed = max(o["elapsed_s"] for o in outcomes)
    per_master = {}
    for port in sorted(before):
        b, a = before[port], after[port]
        cpu_s = a["proc_cpu_s"] - b["proc_cpu_s"]
        calls = sum(n - b["commands"].get(name, (0, 0))[0] for name, (n, _) in a["commands"].items())
        held = results[port] - results_before[port]
        top = sorted(((name, n - b["commands"].get(name, (0, 0))[0],
                       us - b["commands"].get(name, (0, 0))[1])
                      for name, (n, us) in a["commands"].items()), key=lambda t: -t[2])[:8]
        per_master[port] = {"requests": held, "cpu_share_of_core": round(cpu_s / seconds, 3),
                            "cpu_ms_per_request": round(cpu_s * 1e3 / held, 4) if held else None,
                            "commands_per_request": round(calls / held, 2) if held else None,
                            "net_in_bytes_per_request": round((a["net_in"] - b["net_in"]) / held)
                            if held else None,
                            "top_commands_per_request": {
                                name: {"calls": round(n / held, 3), "usec": round(us / held, 2)}
                                for name, n, us in top} if held else {}}
    return {"answered": answered, "failures": sum(o["failures"] for o in outcomes),
            "requests_per_s": round(answered / elapsed, 1), "mean_rows_per_batch": round(rows, 2),
            "per_master": per_master}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="the device's max batch")
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--device", choices=DEVICES, default="sim-fast")
    p.add_argument("--redis-cpu-share", type=float, default=0.0,
                   help="cap each master at this share of a core (0: no cap)")
    p.add_argument("--repeat", type=int, default=1, help="alternations of the two forms")
    p.add_argument("--forms", default="one,spread", help="which forms: one (master), spread")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    from asyncinfer.ops.redis_server import redis_server_binary
    from tests.support.redis_cluster import LocalCluster

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cluster-spread-") as tmp:
        folder = Path(tmp)
        with LocalCluster(folder / "cluster", binary=redis_server_binary(prefer_system=True)) as cluster:
            capped = [cap_cpu(m.process.pid, args.redis_cpu_share) for m in cluster.masters()
                      if args.redis_cpu_share > 0]
            base = cluster.fleet_url()
            with cluster.masters()[0].client() as c:
                version = c.info("server")["redis_version"]
            try:
                for i in range(args.repeat):
                    forms = [(f, u) for f, u, k in (("one master", base, "one"),
                                                    ("spread over 3", base + "&shards=3", "spread"))
                             if k in args.forms.split(",")]
                    for form, url in forms:
                        row = {"form": form, "run": i + 1, **point(cluster, url, args, folder)}
                        runs.append(row)
                        masters = ", ".join(
                            f"{m['requests']} req {m['cpu_share_of_core']:.2f} core "
                            f"{m['cpu_ms_per_request'] or 0:.4f} ms {m['commands_per_request'] or 0} cmd"
                            for m in row["per_master"].values())
                        print(f"{form:>13} #{i + 1}: {row['requests_per_s']:>8} req/s, "
                              f"{row['mean_rows_per_batch']} rows/batch; masters: {masters}", flush=True)
            finally:
                for c in capped:
                    uncap(c)
    result = {"what": " ".join(["bench/cluster_spread.py", *(argv or sys.argv[1:])]),
              "redis_version": version, "runs": runs,
              "host": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
