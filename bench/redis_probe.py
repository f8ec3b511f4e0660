"""What one Redis round trip and one take-script call cost Redis' CPU, alone on a fresh Redis.

    .venv/bin/python bench/redis_probe.py [--out bench/results/redis_probe_DATE.json]

Against one embedded ``redis-server``, read from ``INFO cpu`` (main thread): a PING and a GET
each in a round trip of its own, and ten PINGs in one pipeline (per PING); then the worker's take
script (asyncinfer/broker/take.py, no lease, no STARTED state) on a queue filled by a
``Client`` with the bench's sim requests, taking 1, 2, 4, 8 and 32 messages a call — per call and
per message. The fixed cost of a round trip against the cost per message is what decides how a
fleet's Redis CPU per request moves with the batch size (docs/capacity.md). A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROOMS = (1, 2, 4, 8, 32)


def _cpu_s(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys_main_thread"]) + float(cpu["used_cpu_user_main_thread"])


def _usec_each(client: Any, call: Callable[[], Any], times: int) -> float:
    began = _cpu_s(client)
    for _ in range(times):
        call()
    return (_cpu_s(client) - began) * 1e6 / times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "redis_probe_2026-12-03.json")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import redis

    from asyncinfer import Client
    from asyncinfer.broker.take import Taker
    from asyncinfer.constants import TASK_NAME
    from asyncinfer.ops.benchmark.systems import payload_kwargs
    from asyncinfer.ops.benchmark.workloads import WORKLOADS
    from asyncinfer.ops.redis_server import RedisServer

    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendonly=False, die_with_parent=True).start()
        try:
            r = redis.Redis.from_url(server.url)
            client = Client(broker_url=server.url)
            payloads = [payload_kwargs(WORKLOADS["sim-slow"], i) for i in range(64)]
            queue, taker = "infer.probe", Taker(r)
            pipe = r.pipeline(transaction=False)

            def ten_pings() -> None:
                for _ in range(10):
                    pipe.ping()
                pipe.execute()

            for _ in range(args.rounds):
                row: dict[str, Any] = {
                    "ping_usec": round(_usec_each(r, r.ping, 3000), 1),
                    "get_usec": round(_usec_each(r, lambda: r.get("x"), 3000), 1),
                    "pipelined_ping_usec": round(_usec_each(r, ten_pings, 300) / 10, 1),
                    "take": {}}
                for room in ROOMS:
                    r.delete("unacked", "unacked_index")
                    for i in range(1700 - r.llen(queue)):
                        client.send(TASK_NAME, queue, payloads[i % len(payloads)])
                    calls = taken = 0
                    began = _cpu_s(r)
                    while taken < 1600:
                        taken += len(taker.take([queue], room))
                        calls += 1
                    spent = (_cpu_s(r) - began) * 1e6
                    row["take"][room] = {"usec_per_call": round(spent / calls, 1),
                                         "usec_per_message": round(spent / taken, 1)}
                rounds.append(row)
                print(json.dumps(row), flush=True)
            client.close()
        finally:
            server.stop()
    doc = {"script": "bench/redis_probe.py", "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": rounds}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
