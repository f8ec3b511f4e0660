"""The "crashy" test model's fleet (tests/support/models.py: ``Crashy``): its environment, what
it records on Redis (each value's starts, each batch's values), workers and ``asyncinfer up``
running it, and the counts a fault test prints."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis

from asyncinfer.client import Client
from asyncinfer.ops.status import cluster_status
from tests.support.processes import launch_worker, ready_together, start_up, stop_up, worker_env
from tests.support.waiting import wait_for


def crashy_index(i: int) -> dict[str, np.ndarray]:
    """The inputs of the request of value ``i`` (-1 kills the worker that runs it)."""
    return {"index": np.array([[float(i)]], np.float64)}


def burst_with_killer(client: Client, before: int, after: int,
                      killer: int = -1) -> tuple[list[Any], Any]:
    """Send ``before`` good requests (values 0..), the ``killer``, then ``after`` more in one
    burst; the good ones' futures, in value order, and the killer's."""
    good = [client.submit("crashy", crashy_index(i)) for i in range(before)]
    bad = client.submit("crashy", crashy_index(killer))
    good += [client.submit("crashy", crashy_index(i)) for i in range(before, before + after)]
    return good, bad


def crashy_env(url: str, tag: str, sleep_s: float) -> tuple[str, dict[str, str]]:
    """A prefix of its own for what the model records on ``url``, and the environment of workers
    whose batches take ``sleep_s``."""
    prefix = f"{tag}-{os.urandom(4).hex()}"
    return prefix, {"CRASHY_REDIS_URL": url, "CRASHY_PREFIX": prefix, "CRASHY_SLEEP_S": str(sleep_s)}


def crashy_starts(r: redis.Redis, prefix: str) -> dict[int, int]:
    """How many times the device started each value."""
    return {int(k): int(v) for k, v in r.hgetall(f"{prefix}:starts").items()}


def crashy_batches(r: redis.Redis, prefix: str) -> list[list[int]]:
    """The values of each batch the device started, in order."""
    return [json.loads(b) for b in r.lrange(f"{prefix}:batches", 0, -1)]


def two_crashy_workers(first_url: str, url: str, tmp_path, first_env: dict[str, str],  # noqa: ANN202
                       second_env: dict[str, str]):
    """Workers "first" (on ``first_url``: a proxy's, to cut it off) and "second", both ready."""
    args = ("--device", "cpu", "--models", "crashy")
    first = launch_worker(first_url, tmp_path / "first.log", *args, "--hostname", "first@%h",
                          **first_env)
    second = launch_worker(url, tmp_path / "second.log", *args, "--hostname", "second@%h",
                           **second_env)
    ready_together([first, second])  # started side by side; on a failure both stopped
    return first, second


def report_counts(fault: str, sent: int, answered: int, starts: dict[int, int],
                  seconds: float) -> None:
    """Print a fault's counts (``pytest -s`` shows them)."""
    twice = sum(1 for n in starts.values() if n == 2)
    print(f"\n{fault}: sent {sent}, answered {answered}, lost {sent - answered}, ran twice "
          f"{twice}, more than twice {sum(1 for n in starts.values() if n > 2)}, last answer "
          f"{seconds:.1f} s after the fault")


@contextmanager
def crashy_under_up(url: str, env: dict[str, str], tmp_path) -> Iterator[tuple[Client, list[int]]]:
    """``asyncinfer up`` (no gateway) with one worker of "crashy" on ``url``; yields a client and
    the PIDs of the workers seen (the test adds those it sees later; all are stopped by PID)."""
    log = open(tmp_path / "up.log", "wb")
    up = start_up({**worker_env(url), **env}, log, "--models", "crashy", "--no-gateway")
    client = Client(broker_url=url)
    seen: list[int] = []
    try:
        seen += [w.pid for w in wait_for(lambda: cluster_status(client.app, 0.5).workers, 90,
                                         "a worker")]
        yield client, seen
        seen += [w.pid for w in cluster_status(client.app, 0.5).workers]
    finally:
        client.close()
        stop_up(up, sorted(set(seen)))
        log.close()
