"""What the lost check (asyncinfer/client/lost_check.py) costs: per request at submit, and per
waiting request per look.

    PYTHONPATH=. .venv/bin/python bench/lost_check_cost.py [--requests 20000] [--pairs 3]

One append-only Redis of its own (as ``asyncinfer up`` runs it), no worker: requests stay queued.
Per pair, the same number of ``Client.submit`` calls with ``ASYNCINFER_LOST_AFTER_S=0`` (the plain
LPUSH, no trace) and with the check on (the publish script writing the trace with the push),
alternated so that the machine's noise falls on both. Reported per request: the client's CPU, Redis'
CPU (``INFO cpu``), Redis memory (``INFO memory``; the trace's is the difference). Then, with every
request of the last run waiting, the looks of the check: the client's CPU per waiting request per
look, and Redis' (``INFO commandstats`` of MGET) per key read. A script, not a test: this machine
is too noisy for timed assertions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import RedisServer


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def submit_run(url: str, r: redis.Redis, requests: int, lost_after_s: float) -> dict[str, Any]:
    """Submit ``requests`` requests; the costs per request, and the client (still waiting)."""
    r.flushdb()
    client = Client(settings=Settings.from_env(broker_url=url, lost_after_s=lost_after_s))
    x = np.ones((1, 4), np.float32)
    client.submit("identity", x)  # connections made, scripts loaded
    mem0, cpu0, r0 = int(r.info("memory")["used_memory"]), time.process_time(), redis_cpu_s(r)
    for _ in range(requests):
        client.submit("identity", x)
    cpu1, r1, mem1 = time.process_time(), redis_cpu_s(r), int(r.info("memory")["used_memory"])
    return {"lost_after_s": lost_after_s, "client_us": (cpu1 - cpu0) / requests * 1e6,
            "redis_us": (r1 - r0) / requests * 1e6, "memory_bytes": (mem1 - mem0) / requests,
            "client": client}


def look_cost(client: Client, r: redis.Redis, looks: int) -> dict[str, Any]:
    """Let the check of ``client`` look ``looks`` more times at its waiting requests."""
    check = client.watcher.lost_check
    assert check is not None
    r.config_resetstat()
    cpu0, keys0, looks0 = check.cpu_s, check.keys_read, check.looks
    deadline = time.monotonic() + check.period_s * (looks + 2) + 10
    while check.looks < looks0 + looks and time.monotonic() < deadline:
        time.sleep(0.1)
    keys = check.keys_read - keys0
    mget = r.info("commandstats").get("cmdstat_mget", {"usec": 0})
    return {"waiting": len(check), "looks": check.looks - looks0, "keys_read": keys,
            "client_us_per_key": (check.cpu_s - cpu0) / max(1, keys) * 1e6,
            "redis_us_per_key": float(mget["usec"]) / max(1, keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--lost-after-s", type=float, default=2.0,
                        help="the bound of the runs with the check on (short: looks come fast)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp), appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        runs = []
        for _ in range(args.pairs):
            for lost_after_s in (0.0, args.lost_after_s):
                run = submit_run(server.url, r, args.requests, lost_after_s)
                client = run.pop("client")
                if lost_after_s:
                    run["looks"] = look_cost(client, r, 4)
                client.close()
                runs.append(run)
                print(json.dumps(run), flush=True)
        for lost_after_s in (0.0, args.lost_after_s):
            mine = [x for x in runs if x["lost_after_s"] == lost_after_s]
            print(f"lost_after_s={lost_after_s:g}: client "
                  f"{sorted(x['client_us'] for x in mine)[len(mine) // 2]:.1f} µs/request, Redis "
                  f"{sorted(x['redis_us'] for x in mine)[len(mine) // 2]:.1f} µs/request, memory "
                  f"{sorted(x['memory_bytes'] for x in mine)[len(mine) // 2]:.0f} B/request "
                  f"(medians of {len(mine)})")
        r.close()


if __name__ == "__main__":
    main()
