"""The fleet's faults on a real Redis Cluster (3 masters of real redis-server processes, with their
replicas), at the shipped defaults: a worker killed holding requests, the shard's master killed
while requests stream (its replica promoted), and the shard's slot migrated to another master
while requests stream. Each counts sent / accepted / answered / lost / ran twice and prints them
(``pytest -s`` shows them)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.broker.cluster_client import shard_client
from asyncinfer.broker.shards import shard_tags, tag_slot
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import BrokerRefused, BrokerUnavailable, NotReplicated, RequestLost
from tests.support.crashy import (
    answered_by_second,
    crashy_env,
    crashy_index,
    crashy_starts,
    crashy_under_up,
    held_by_first,
    killer_isolated,
    report_counts,
    two_crashy_workers,
)
from tests.support.processes import start_worker, stop_together
from tests.support.redis_cluster import LocalCluster, ids_on_shard
from tests.support.rows import identity_row

#: As in test_fleet.py: the lease (10 s) and a sweep and the work, far below the visibility timeout.
ANSWER_WITHIN_S = 60
#: The slot of the fleet's one shard.
SLOT = tag_slot(shard_tags(1)[0])





@pytest.mark.timeout(180)
def test_a_worker_killed_holding_requests_on_a_cluster_another_answers_them(tmp_path: Path) -> None:
    # Given two workers on a cluster at the default settings, the first on a slow kernel (15 s a
    # batch), and 12 requests held by the first: a batch on its device, the others waiting
    with LocalCluster(tmp_path / "cluster") as cluster:
        url = cluster.fleet_url()
        r = shard_client(url, 0)
        prefix, slow = crashy_env(url, "held", 15)
        first, second = two_crashy_workers(url, url, tmp_path, slow, {**slow, "CRASHY_SLEEP_S": "0.2"})
        client = Client(broker_url=url)
        try:
            futures = held_by_first(client, r, prefix, second.pid)
            # When the first is killed outright
            struck = time.monotonic()
            first.process.kill()
            first.process.wait()
            # Then the second answers every one within the lease and a sweep; those on the
            # first's device ran once more each, together, the others once
            answered_by_second(futures, r, prefix, struck, ANSWER_WITHIN_S, "kill -9, on a cluster,")
        finally:
            client.close()
            for w in (first, second):
                if w.process.poll() is None:
                    os.kill(w.pid, signal.SIGCONT)
            stop_together([first, second])
            r.close()


def _stream_through(client: Client, model: str, rate_hz: float, fault: Callable[[], None],
                    before: int, after: int) -> dict[str, Any]:
    """Send requests at ``rate_hz`` from a pool of threads (a submit waiting out the fault holds up
    no other): ``before`` of them, then ``fault()`` in its own thread, and on until ``after``
    were sent once it returned. sent / refused (at the submit) / answered / lost by phase
    (before the fault, during it, after it), and how long the fault took."""
    def send(index: int) -> tuple[str, Any]:
        request_id = f"{index}-{uuid.uuid4().hex[:8]}"
        try:
            return request_id, client.submit(model, identity_row(index), request_id=request_id).sent()
        except (BrokerUnavailable, NotReplicated) as exc:
            return request_id, exc

    phases: list[tuple[str, Any]] = []
    began, ended = 0.0, []
    with ThreadPoolExecutor(max_workers=64) as pool:
        faulting = None
        while sum(1 for phase, _ in phases if phase == "after") < after:
            if len(phases) == before:
                began, faulting = time.monotonic(), pool.submit(lambda: (fault(), ended.append(
                    time.monotonic())))
            phase = "before" if faulting is None else ("after" if ended else "during")
            phases.append((phase, pool.submit(send, len(phases))))
            time.sleep(1.0 / rate_hz)
        assert faulting is not None
        faulting.result(timeout=60)
        outcomes = [(phase, f.result()) for phase, f in phases]
    deadline = time.monotonic() + 60.0
    counts: dict[str, Any] = {p: {"sent": 0, "refused": 0, "answered": 0, "lost": 0}
                              for p in ("before", "during", "after")}
    lost = []
    for phase, (request_id, outcome) in outcomes:
        row = counts[phase]
        row["sent"] += 1
        if isinstance(outcome, Exception):
            row["refused"] += 1
            continue
        try:
            outcome.result(timeout=max(0.1, deadline - time.monotonic()))
            row["answered"] += 1
        except Exception as exc:  # noqa: BLE001 - counted
            row["lost"] += 1
            lost.append(f"{request_id}: {type(exc).__name__}: {exc}"[:200])
    counts["lost_ids"] = lost[:5]
    counts["fault_s"] = round(ended[0] - began, 2)
    return counts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [0, 1])
def test_the_fleet_follows_its_shard_s_master_failing_over_while_requests_stream(
        tmp_path: Path, replicas: int) -> None:
    # Given a worker and a client on a cluster whose masters have 1 + replicas replicas each (one
    # left after the promotion, to confirm durable submits); with replicas=1 every submit and
    # result write waits for a replica
    with LocalCluster(tmp_path / "cluster", replicas_per_master=1 + replicas) as cluster:
        url = cluster.fleet_url()
        env = {"ASYNCINFER_SUBMIT_REPLICAS": str(replicas), "ASYNCINFER_SUBMIT_REPLICAS_TIMEOUT_S": "5"}
        worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                              "identity", "--concurrency", "32", **env)
        client = Client(settings=Settings(broker_url=url, connect_timeout_s=2.0,
                                          submit_replicas=replicas, submit_replicas_timeout_s=5.0))
        try:
            assert client.infer("identity", identity_row(0), timeout_s=30) is not None
            old = cluster.master_of_slot(SLOT)

            def fail_over() -> None:
                cluster.kill_master(old)
                cluster.wait_failover(old)

            # When the shard's master is SIGKILLed in the middle of a paced stream of requests
            counts = _stream_through(client, "identity", 40, fail_over, before=40, after=60)
            print(f"failover of the shard's master, replicas={replicas}:", counts)
            # Then the same worker process (never restarted) and client follow the promoted
            # replica: every request sent after the promotion is accepted and answered; those
            # sent before it are answered (with durable submits every one: a write confirmed by
            # a replica survives its master)
            assert worker.process.poll() is None
            assert counts["after"] == {"sent": 60, "refused": 0, "answered": 60, "lost": 0}, counts
            if replicas:
                assert counts["before"] == {"sent": 40, "refused": 0, "answered": 40, "lost": 0}
                assert counts["during"]["lost"] == 0, counts
            else:
                assert counts["before"]["answered"] >= 30, counts
        finally:
            client.close()
            worker.stop()


@pytest.mark.timeout(180)
def test_one_model_spread_over_three_masters_one_master_killed_while_requests_stream(
        tmp_path: Path) -> None:
    # Given one model spread over 3 shards (one a master), a worker taking from all three
    with LocalCluster(tmp_path / "cluster") as cluster:
        url = cluster.fleet_url("&shards=3")
        worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                              "identity", "--concurrency", "32")
        client = Client(settings=Settings(broker_url=url, connect_timeout_s=2.0))
        try:
            assert client.infer("identity", identity_row(0), timeout_s=30) is not None
            old = cluster.master_of_slot(tag_slot(shard_tags(3)[1]))
            others = [m.port for m in cluster.masters() if m.port != old.port]

            def fail_over() -> None:
                cluster.kill_master(old)
                cluster.wait_failover(old)

            # When the master of shard 1 is SIGKILLed in the middle of a paced stream
            counts = _stream_through(client, "identity", 40, fail_over, before=40, after=60)
            print("failover of one of three masters, one model spread over them:", counts)
            # Then the worker (never restarted) and the client follow the promoted replica:
            # every request sent after the promotion, whatever its shard, is accepted and
            # answered; nothing accepted before it is lost on the masters that stayed
            assert worker.process.poll() is None
            assert counts["after"] == {"sent": 60, "refused": 0, "answered": 60, "lost": 0}, counts
            assert counts["before"]["answered"] >= 26, counts  # a third may be on the lost master
            survivors = [cluster.master_of_slot(tag_slot(shard_tags(3)[k])).port for k in (0, 2)]
            assert sorted(survivors) == sorted(others)
        finally:
            client.close()
            worker.stop()


@pytest.mark.timeout(180)
def test_one_master_frozen_the_other_shards_requests_are_answered_meanwhile(tmp_path: Path) -> None:
    # Given one model spread over 3 shards, a worker taking from all three, on a cluster that
    # would fail a master over only after 30 s
    with LocalCluster(tmp_path / "cluster", node_timeout_ms=30_000) as cluster:
        url = cluster.fleet_url("&shards=3")
        worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                              "identity", "--concurrency", "4")
        client = Client(broker_url=url)
        frozen = cluster.master_of_slot(tag_slot(shard_tags(3)[1]))
        try:
            assert client.infer("identity", identity_row(0), timeout_s=30) is not None
            # When shard 1's master freezes (SIGSTOP) long enough that the worker's intake of it
            # is past its blocking wait and into a take that hangs there, and then requests come
            # for every shard
            os.kill(frozen.pid, signal.SIGSTOP)
            time.sleep(12.0)  # the watch's socket timeout (block_s + 5 s) and a backoff
            struck = time.monotonic()
            others = [client.submit("identity", identity_row(i), request_id=rid)
                      for i, rid in enumerate(ids_on_shard(0, 15) + ids_on_shard(2, 15))]
            stuck = [client.submit("identity", identity_row(100 + i), request_id=rid)
                     for i, rid in enumerate(ids_on_shard(1, 10))]
            # Then the requests of the other shards are answered while it is still frozen
            answers = [f.result(timeout=20) for f in others]
            answered_s = time.monotonic() - struck
            assert [float(a["input"][0, 0]) for a in answers] == [float(i) for i in range(30)]
            assert not any(f.done() for f in stuck)
            # and once it thaws, its own, none lost
            os.kill(frozen.pid, signal.SIGCONT)
            thawed = time.monotonic()
            later = [float(f.result(timeout=60)["input"][0, 0]) for f in stuck]
            assert later == [100.0 + i for i in range(10)]
            print(f"\none of three masters frozen: 30 requests of the other shards answered in "
                  f"{answered_s:.1f} s while it was; its 10 answered {time.monotonic() - thawed:.1f} s "
                  f"after it thawed; lost 0")
            assert worker.process.poll() is None
        finally:
            if frozen.alive():
                os.kill(frozen.pid, signal.SIGCONT)
            client.close()
            worker.stop()


@pytest.mark.timeout(180)
def test_one_master_full_refuses_its_own_shard_s_submits_and_holds_up_nothing_else(
        tmp_path: Path) -> None:
    # Given one model spread over 3 shards and a worker taking from all three, with 5 requests of
    # shard 1 accepted and waiting (the worker frozen meanwhile)
    with LocalCluster(tmp_path / "cluster") as cluster:
        url = cluster.fleet_url("&shards=3")
        worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                              "identity")
        client = Client(broker_url=url)
        full = cluster.master_of_slot(tag_slot(shard_tags(3)[1]))
        m = full.client()
        try:
            assert client.infer("identity", identity_row(0), timeout_s=30) is not None
            os.kill(worker.pid, signal.SIGSTOP)
            waiting = [client.submit("identity", identity_row(200 + i), request_id=rid).sent(timeout_s=30)
                       for i, rid in enumerate(ids_on_shard(1, 5))]
            # When shard 1's master is full (maxmemory below what it holds, noeviction, as
            # Celery requires), and requests come for every shard
            m.config_set("maxmemory-policy", "noeviction")
            m.config_set("maxmemory", max(1, int(m.info("memory")["used_memory"]) - (1 << 20)))
            os.kill(worker.pid, signal.SIGCONT)
            struck = time.monotonic()
            others = [client.submit("identity", identity_row(i), request_id=rid)
                      for i, rid in enumerate(ids_on_shard(0, 15) + ids_on_shard(2, 15))]
            refused = []
            for rid in ids_on_shard(1, 10):
                with pytest.raises(BrokerRefused, match=rf"request {rid}: broker is out of memory"):
                    client.submit("identity", identity_row(100), request_id=rid).sent(timeout_s=30)
                refused.append(rid)
            # Then the other shards' requests are answered meanwhile, and each of shard 1's new
            # submits is refused naming itself and Redis' reason
            answers = [f.result(timeout=30) for f in others]
            answered_s = time.monotonic() - struck
            assert [float(a["input"][0, 0]) for a in answers] == [float(i) for i in range(30)]
            # (the 5 accepted there may be answered even now: the take's first write, its pop,
            # frees memory, and Redis lets a script that has written go on)
            while_full = sum(1 for f in waiting if f.done())
            # When memory is given back, the 5 are answered by the same worker, none lost
            m.config_set("maxmemory", 0)
            freed = time.monotonic()
            later = [float(f.result(timeout=60)["input"][0, 0]) for f in waiting]
            assert later == [200.0 + i for i in range(5)]
            again = client.infer("identity", identity_row(7), timeout_s=30, request_id=ids_on_shard(1, 1)[0])
            assert float(again["input"][0, 0]) == 7.0
            assert worker.process.poll() is None
            print(f"\none of three masters full: sent 45, accepted 35, refused 10 (its shard's, "
                  f"each naming itself), answered 35 (30 of the other shards in {answered_s:.1f} s "
                  f"while it was full, {while_full} of its 5 accepted before it filled; all 5 "
                  f"{time.monotonic() - freed:.1f} s after memory came back), lost 0")
        finally:
            if worker.process.poll() is None:
                os.kill(worker.pid, signal.SIGCONT)
            m.config_set("maxmemory", 0)
            m.close()
            client.close()
            worker.stop()


@pytest.mark.timeout(180)
def test_the_fleet_follows_its_shard_s_slot_migrating_while_requests_stream(tmp_path: Path) -> None:
    # Given a worker on a cluster, serving a model that counts each value's starts on the device
    with LocalCluster(tmp_path / "cluster") as cluster:
        url = cluster.fleet_url()
        r = shard_client(url, 0)
        prefix, env = crashy_env(url, "migrating", 0.05)
        worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "crashy",
                              **env)
        client = Client(broker_url=url)
        try:
            source = cluster.master_of_slot(SLOT)
            target = next(m for m in cluster.masters() if m.port != source.port)
            moved: list[int] = []

            def migrate() -> None:  # the slot's keys moved a few at a time, then the slot
                cluster.begin_migration(SLOT, target)
                while True:
                    step = cluster.move_keys(SLOT, 3)
                    moved.append(step)
                    if not step:
                        break
                    time.sleep(0.05)
                cluster.finish_migration(SLOT, target)

            # When the shard's slot migrates to another master while requests stream in
            sent = time.monotonic()
            futures = []
            with ThreadPoolExecutor(max_workers=1) as pool:
                for i in range(150):
                    if i == 30:
                        migrating = pool.submit(migrate)
                    futures.append(client.submit("crashy", crashy_index(i)))
                    time.sleep(0.02)
                migrating.result(timeout=60)
            answers = [f.result(timeout=ANSWER_WITHIN_S) for f in futures]
            last_s = time.monotonic() - sent
            # Then every request is answered once, by the same worker process, from the new master
            assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(150)]
            starts = crashy_starts(r, prefix)
            report_counts(f"the shard's slot migrated ({sum(moved)} keys moved)", 150, len(answers),
                          starts, last_s)
            assert starts == {i: 1 for i in range(150)}
            assert sum(moved) > 0 and cluster.master_of_slot(SLOT).port == target.port
            assert worker.process.poll() is None
        finally:
            client.close()
            worker.stop()
            r.close()


@pytest.mark.timeout(240)
def test_a_request_that_kills_its_worker_on_a_cluster_is_isolated_then_fails(tmp_path: Path) -> None:
    # Given `asyncinfer up` on a cluster with one worker and a model that keeps its dead letters
    with LocalCluster(tmp_path / "cluster") as cluster:
        url = cluster.fleet_url()
        r = shard_client(url, 0)
        prefix, env = crashy_env(url, "killer", 0.1)
        env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({"crashy": {"dead_letter": True}})
        with crashy_under_up(url, env, tmp_path) as (client, _):
            # When 40 good requests and one that kills its worker are sent in one burst, then
            # every good one is answered and the killer isolated, failed for good and kept
            killer_isolated(client, r, prefix, ANSWER_WITHIN_S, "asyncinfer up, on a cluster")
        r.close()


@pytest.mark.timeout(180)
def test_requests_a_failover_lost_end_with_request_lost_not_a_hang(tmp_path: Path) -> None:
    # Given a cluster whose shard's replica stopped taking its master's writes (frozen), and 20
    # requests accepted by the master alone (no worker serves them yet)
    with LocalCluster(tmp_path / "cluster") as cluster:
        url = cluster.fleet_url()
        client = Client(settings=Settings(broker_url=url, lost_after_s=4.0, connect_timeout_s=2.0))
        worker = None
        try:
            kept = [client.submit("identity", identity_row(i)).sent(timeout_s=30) for i in range(5)]
            master = cluster.master_of_slot(SLOT)
            with master.client() as m:
                assert m.wait(1, 5000) == 1  # the 5 kept are on the replica
            replica = cluster.replicas(of=master)[0]
            os.kill(replica.pid, signal.SIGSTOP)
            # (32 MB written first fill the sockets to the frozen replica: what follows stays in
            # the master's output buffer, and dies with it)
            with shard_client(url, 0) as r:
                r.set("filler", b"x" * (32 << 20))
            lost = [client.submit("identity", identity_row(i)) for i in range(20)]
            for f in lost:  # accepted by the master before it dies (a submit goes apart)
                f.sent(timeout_s=30)
            # When the master dies, and the replica, thawed, is promoted without them
            cluster.kill_master(master)
            os.kill(replica.pid, signal.SIGCONT)
            promoted = cluster.wait_failover(master)
            assert promoted.port == replica.port
            worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                                  "identity")
            # Then the kept are answered, and each lost one's future ends with RequestLost
            assert [f.result(timeout=60)["input"].tolist() for f in kept] == [
                [[float(i)]] for i in range(5)]
            outcomes = []
            for f in lost:
                try:
                    f.result(timeout=60)
                    outcomes.append("answered")
                except RequestLost:
                    outcomes.append("lost")
            print("a failover to a replica behind: kept 5 answered;",
                  {k: outcomes.count(k) for k in ("answered", "lost")})
            assert outcomes == ["lost"] * 20
        finally:
            client.close()
            if worker is not None:
                worker.stop()
