"""Redis Sentinel: Celery's ``sentinel://`` URLs for broker and results, failover without restarts,
and ``ASYNCINFER_SUBMIT_REPLICAS``.

The tests run a Sentinel group of their own (master, one replica, three Sentinels:
tests/support/sentinel.py), so what they count is theirs alone. The URLs, settings and Celery's
configuration, with no server: tests/unit/test_sentinel.py.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from celery.result import AsyncResult

from asyncinfer.broker.connections import (
    MASTER_CHECK_S,
    redis_client,
    require_replicas,
    wait_replicas,
)
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import BrokerUnavailable, NotReplicated
from asyncinfer.ops.status import queue_depths
from tests.support.processes import start_worker
from tests.support.rows import identity_row
from tests.support.sentinel import SentinelGroup
from tests.support.waiting import wait_for

# -- against a real Sentinel group ----------------------------------------------------------------


@pytest.fixture()
def group(tmp_path: Path):  # type: ignore[no-untyped-def]
    with SentinelGroup(tmp_path / "sentinel") as g:
        yield g


def _settings(url: str, **extra: object) -> Settings:
    return Settings(broker_url=url, visibility_timeout_s=5.0, connect_timeout_s=2.0, **extra)


#: Seconds each batch of the failover stream sleeps on the device ("sleep" model).
BATCH_S = 0.25



@pytest.mark.timeout(60)
def test_round_trip_through_sentinel_with_passwords_and_a_database(tmp_path: Path) -> None:
    # Given a Sentinel group whose master wants a password and whose Sentinels want another, and a
    # worker and a client configured with the contract's URL form (database in the last entry)
    with SentinelGroup(tmp_path / "sentinel", master_name="infer", password="masterpw",
                       sentinel_password="sentinelpw") as group:
        url = group.url(db=2)
        env = {"ASYNCINFER_SENTINEL_MASTER": "infer", "ASYNCINFER_SENTINEL_PASSWORD": "sentinelpw"}
        worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                              "identity", "--concurrency", "4", **env)
        client = Client(settings=_settings(url, sentinel_master="infer",
                                           sentinel_password="sentinelpw"))
        try:
            # When requests go through the fast path and through Celery's AsyncResult
            futures = [client.submit("identity", identity_row(i)) for i in range(20)]
            answers = [f.result(timeout=30) for f in futures]
            stored = AsyncResult(futures[0].id, app=client.app).get(timeout=10)
            # Then each comes back, and the results live in database 2 of the master
            assert [float(a.as_numpy("input")[0, 0]) for a in answers] == list(range(20))
            assert stored["id"] == futures[0].id
            master = group.master_client()
            master.select(2)
            assert master.exists(f"celery-task-meta-{futures[0].id}")
            master.close()
            assert "fast consumer on infer.identity" in worker.log()
            assert queue_depths(client.app, {"identity"}) == {"identity": 0}
        finally:
            client.close()
            worker.stop()


def _stream(client: Client, group: SentinelGroup, *, rate_hz: float, before_kill: int,
            after_promotion: int, min_replicas: int) -> dict[str, object]:
    """Send ``before_kill`` requests at ``rate_hz``, SIGKILL the master, keep sending at the same
    pace (from a pool of threads, so a submit waiting out the failover holds up no other) through
    the failover and ``after_promotion`` more once a replica is promoted (and has ``min_replicas``
    of its own) and a client's master check (every ``MASTER_CHECK_S``) has had time to see it;
    wait for the answers. Returns the counts, by phase: before the kill, during the
    failover, after the promotion."""
    phases = ("before", "during", "after")

    def send(index: int, phase: str) -> tuple[str, str, object]:
        request_id = f"{phase}-{index}-{uuid.uuid4().hex[:8]}"
        try:
            return phase, request_id, client.submit("sleep", identity_row(BATCH_S),
                                                    request_id=request_id).sent()
        except (BrokerUnavailable, NotReplicated) as exc:
            return phase, request_id, exc

    pause_s = 1.0 / rate_hz
    submits = []
    phase, old_port, killed_at, promoted_at = "before", 0, 0.0, 0.0
    with ThreadPoolExecutor(max_workers=64) as pool:
        while sum(1 for f in submits if f.phase == "after") < after_promotion:
            if phase == "before" and len(submits) >= before_kill:
                old_port = group.kill_master()
                killed_at, phase = time.monotonic(), "during"
            if phase == "during" and not promoted_at and group.promoted_or_none(old_port, min_replicas):
                promoted_at = time.monotonic()
            # a client re-checks its master at most every MASTER_CHECK_S: "after" starts then
            if phase == "during" and promoted_at and time.monotonic() >= promoted_at + MASTER_CHECK_S:
                phase = "after"
            future = pool.submit(send, len(submits), phase)
            future.phase = phase  # type: ignore[attr-defined]
            submits.append(future)
            time.sleep(pause_s)
        outcomes = [f.result() for f in submits]
    deadline = time.monotonic() + 40.0  # the worker catches up on what queued in the failover
    counts = {p: {"sent": 0, "refused": 0, "answered": 0, "lost": 0} for p in phases}
    refusals, lost = [], []
    for phase_of, request_id, outcome in outcomes:
        row = counts[phase_of]
        if isinstance(outcome, Exception):
            row["refused"] += 1
            refusals.append(f"{request_id}: {type(outcome).__name__}: {outcome}")
            continue
        row["sent"] += 1
        try:
            outcome.result(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[attr-defined]
            row["answered"] += 1
        except Exception as exc:  # noqa: BLE001 - counted
            row["lost"] += 1
            lost.append(f"{request_id}: {type(exc).__name__}")
    report = {"promotion_s": round(promoted_at - killed_at, 2), **counts,
              "refusals": refusals[:3] + [r for r in refusals if r.startswith("after-")][:3],
              "lost_ids": lost[:5]}
    print("failover counts:", report)
    return report


@pytest.mark.timeout(100)
@pytest.mark.parametrize("replicas", [0, 1])
def test_worker_and_client_follow_a_failover_without_restart(tmp_path: Path, replicas: int) -> None:
    # Given a worker and a client on the Sentinel URL; with replicas=1 every submit and result
    # write waits for a replica, and the group has two (one is left after the promotion)
    group = SentinelGroup(tmp_path / "sentinel", replicas=1 + replicas).start()
    url = group.url(db=0)
    # A replica's confirmation may take a while on a loaded host (the suite runs beside it): a
    # replica that is merely slow must not count as a refusal, so WAIT gets 5 s
    env = {"ASYNCINFER_VISIBILITY_TIMEOUT_S": "5", "ASYNCINFER_SUBMIT_REPLICAS": str(replicas),
           "ASYNCINFER_SUBMIT_REPLICAS_TIMEOUT_S": "5"}
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "identity,sleep", "--concurrency", "32", **env)
    client = Client(settings=_settings(url, submit_replicas=replicas,
                                       submit_replicas_timeout_s=5.0))
    try:
        assert client.infer("identity", identity_row(0), timeout_s=30) is not None
        # When the master is SIGKILLed in the middle of a paced stream of requests (each batch
        # takes BATCH_S on the device, so some are in flight at the kill)
        counts = _stream(client, group, rate_hz=40, before_kill=40, after_promotion=60,
                         min_replicas=replicas)
        # Then the same worker process (never restarted) and client accept and answer every
        # request sent after the replica's promotion, which took Sentinel's few seconds
        assert worker.process.poll() is None
        assert counts["after"] == {"sent": 60, "refused": 0, "answered": 60, "lost": 0}, counts
        assert 0.5 < float(counts["promotion_s"]) < 15  # type: ignore[arg-type]
        # and those sent before the kill were answered too (any loss: in flight at the kill)
        assert counts["before"]["answered"] >= 30, counts  # type: ignore[index]
    finally:
        client.close()
        worker.stop()
        group.stop()


def test_require_replicas_confirms_writes_and_names_a_shortfall(group: SentinelGroup) -> None:
    # Given a Sentinel-managed client of the group's master and its one replica
    client = redis_client(group.url(), Settings(connect_timeout_s=2.0))
    try:
        # When a transaction writes, then one replica is required, then two
        pipe = client.pipeline(transaction=True)
        pipe.set("k", "v").lpush("l", "x")
        pipe.execute()
        # Then one confirms at once; two cannot: NotReplicated names the request and the counts
        assert require_replicas(client, 1, 2000, "request r1") == 1
        started = time.monotonic()
        with pytest.raises(NotReplicated, match=r"request r2: .* 1 of 2 replicas .* 200 ms") as err:
            require_replicas(client, 2, 200, "request r2")
        assert time.monotonic() - started >= 0.15
        assert (err.value.confirmed, err.value.required) == (1, 2)
        # And a replica that stopped acknowledging does not confirm a new write
        replica = group.data[group.replica_port].process.pid
        os.kill(replica, signal.SIGSTOP)
        try:
            client.set("k2", "v")
            assert wait_replicas(client, 1, 300) == 0
        finally:
            os.kill(replica, signal.SIGCONT)
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_submit_replicas_makes_submits_and_result_writes_wait_for_a_replica(
        group: SentinelGroup, tmp_path: Path) -> None:
    # Needs the wiring of ASYNCINFER_SUBMIT_REPLICAS in publisher.py and result_writer.py.
    # Given a worker and a client that both want one replica to confirm their writes
    url = group.url()
    env = {"ASYNCINFER_SUBMIT_REPLICAS": "1", "ASYNCINFER_SUBMIT_REPLICAS_TIMEOUT_S": "0.5"}
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "identity",
                          "--concurrency", "4", **env)
    client = Client(settings=_settings(url, submit_replicas=1, submit_replicas_timeout_s=0.3))
    replica = group.data[group.replica_port].process.pid
    try:
        assert client.infer("identity", identity_row(1), timeout_s=30) is not None
        # When the replica stops acknowledging and a request is submitted
        os.kill(replica, signal.SIGSTOP)
        try:
            with pytest.raises(NotReplicated, match=r"request r-stopped: .* 0 of 1 replicas"):
                client.submit("identity", identity_row(2), request_id="r-stopped").sent()
            # Then the submit said so; the request is on the master all the same, and the worker
            # answers it, logging that its result write was not confirmed either
            stored = AsyncResult("r-stopped", app=client.app).get(timeout=30)
            assert stored["id"] == "r-stopped"
            wait_for(lambda: "ASYNCINFER_SUBMIT_REPLICAS" in worker.log(), 10,
                     "the worker's replica shortfall warning")
        finally:
            os.kill(replica, signal.SIGCONT)
        # And once the replica is back, submitting the same ID again is confirmed and is the
        # same request (sent once)
        again = client.submit("identity", identity_row(2), request_id="r-stopped")
        assert float(again.result(timeout=30).as_numpy()[0, 0]) == 2.0
    finally:
        client.close()
        worker.stop()


def test_a_client_leaves_a_master_that_sentinel_no_longer_names(group: SentinelGroup) -> None:
    # Given a Sentinel-managed client writing to the master
    client = redis_client(group.url(), Settings(connect_timeout_s=2.0))
    try:
        client.set("before", "1")
        old = group.master()
        # When a graceful failover promotes the replica (the old master stays up, still a master
        # for several seconds until Sentinel demotes it)
        with group.sentinel_client() as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", group.master_name)
        new = wait_for(lambda: group.master() if group.master() != old else None, 15,
                       "Sentinel naming the promoted replica")
        # Then within about a master check the client's writes go to the new master
        wait_for(lambda: client.set("probe", "1") and client.connection_pool.master_address == new,
                 5, "the client following the new master", poll_s=0.1)
        client.set("after", "1")
        with redis.Redis(host=new[0], port=new[1]) as direct:
            assert direct.get("after") == b"1"
    finally:
        client.close()
