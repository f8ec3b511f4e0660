"""The "crashy" test model's fleet (tests/support/models.py: ``Crashy``): its environment, what
it records on Redis (each value's starts, each batch's values), workers and ``asyncinfer up``
running it, and the counts a fault test prints."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.errors import WorkerLost
from asyncinfer.ops.status import cluster_status
from asyncinfer.wire.keys import LEASES_KEY, UNACKED_KEY
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


def killer_isolated(client: Client, r: redis.Redis, prefix: str, within_s: float, where: str) -> None:
    """Send 40 good "crashy" requests and one that kills every worker that runs it (-1) in one
    burst, and check what the fleet (``asyncinfer up``, restarting its worker; the model keeps its
    dead letters) makes of them: every good one answered, none started more than twice; the
    killer failed for good, naming its deaths, after at most N + 1 of them; after its first death
    it ran again only with batch-mates that died with it (on a loaded host the suspects put back
    can reach the restarted worker in more than one take), then alone; kept as a dead letter.
    Prints the counts, naming ``where``."""
    good, killer = burst_with_killer(client, 20, 20)
    sent_at = time.monotonic()
    answers = [f.result(timeout=within_s) for f in good]
    last_s = time.monotonic() - sent_at
    assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(40)]
    with pytest.raises(WorkerLost, match="died 3 times"):
        killer.result(timeout=within_s)
    starts = crashy_starts(r, prefix)
    assert 3 <= starts[-1] <= 4 and all(starts[i] <= 3 for i in range(40))
    killer_batches = [b for b in crashy_batches(r, prefix) if -1 in b]
    assert set(killer_batches[1]) <= set(killer_batches[0]), killer_batches
    assert killer_batches[2:] == [[-1]] * (starts[-1] - 2)
    dead = [json.loads(e) for e in r.lrange("asyncinfer:dead:crashy", 0, -1)]
    assert [(d["request_id"], d["reason_type"]) for d in dead] == [(killer.id, "WorkerLost")]
    report_counts(f"a request that kills its worker, among 40 ({where})", 41, len(answers) + 1,
                  starts, last_s)


def held_by_first(client: Client, r: redis.Redis, prefix: str, second_pid: int,
                  shards: Sequence[redis.Redis] = ()) -> list[Any]:
    """12 "crashy" requests held by the first of two workers (the second frozen meanwhile): a
    batch on its device, the others waiting, all leased (on ``r``, or across ``shards``: the
    clients of every shard of a spread cluster URL); their futures, in value order."""
    every = list(shards) or [r]
    os.kill(second_pid, signal.SIGSTOP)
    futures = [client.submit("crashy", crashy_index(i)) for i in range(12)]
    wait_for(lambda: sum(s.hlen(UNACKED_KEY) for s in every) == 12
             and sum(s.llen("infer.crashy") for s in every) == 0, 30,
             "the first worker to hold all 12")
    wait_for(lambda: crashy_batches(r, prefix), 30, "a batch on the first worker's device")
    os.kill(second_pid, signal.SIGCONT)
    assert sum(s.zcard(LEASES_KEY) for s in every) == 12
    return futures


def answered_by_second(futures: list[Any], r: redis.Redis, prefix: str, struck: float,
                       within_s: float, fault: str, *, together: bool = True,
                       shard_of: Callable[[str], int] | None = None) -> None:
    """The 12 of :func:`held_by_first`, answered by the second worker within ``within_s``; those
    on the first's device ran once more each (``together``: in one batch, as the suspects they
    are, where deaths on the device are counted: a lost worker costs a batch time, not one per
    row; with ``shard_of``, a request ID's shard of a spread URL: one batch per shard at most,
    each shard's suspects put back and taken on their own), the others once. Prints the counts,
    naming ``fault``."""
    answers = [f.result(timeout=within_s) for f in futures]
    last_s = time.monotonic() - struck
    assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(12)]
    assert {a.parameters["worker"].split("@")[0] for a in answers} == {"second"}
    on_device = crashy_batches(r, prefix)[0]
    starts = crashy_starts(r, prefix)
    assert starts == {i: 2 if i in on_device else 1 for i in range(12)}
    if together:
        later = [sorted(b) for b in crashy_batches(r, prefix)[1:] if set(b) & set(on_device)]
        if shard_of is None:
            assert later == [sorted(on_device)], later
        else:
            # only suspects in those batches, at most one a shard, each shard's suspects in one
            shards = {shard_of(futures[i].id) for i in on_device}
            assert set().union(*later) == set(on_device) and len(later) <= len(shards), later
            for shard in shards:
                mine = {i for i in on_device if shard_of(futures[i].id) == shard}
                assert any(mine <= set(b) for b in later), (shard, mine, later)
    report_counts(f"{fault} of a worker holding 12", 12, len(answers), starts, last_s)
