"""A fleet's faults at the shipped defaults (no visibility timeout or lease set by the test): a
worker killed, frozen or cut off from Redis while it holds requests on a slow kernel, a live
worker on a kernel longer than its lease, and a request that kills every worker that runs it,
under ``asyncinfer up``.

Each counts sent / answered / lost / ran twice and the seconds to the last answer, and prints
them (``pytest -s`` shows them); the bounds the futures wait are far below the visibility
timeout's hour, so a request that came back only through it fails the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from urllib.parse import urlsplit

import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import WorkerLost
from asyncinfer.wire.keys import DEATHS_PREFIX, LEASES_KEY, UNACKED_KEY
from tests.support.crashy import (
    answered_by_second,
    burst_with_killer,
    crashy_batches,
    crashy_env,
    crashy_index,
    crashy_starts,
    crashy_under_up,
    held_by_first,
    killer_isolated,
    report_counts,
    two_crashy_workers,
)
from tests.support.lost import lost_check_of
from tests.support.processes import (
    stop_together,
)
from tests.support.proxy import Partition
from tests.support.sentinel import SentinelGroup
from tests.support.waiting import wait_for

#: How long a future may wait here: the lease (10 s) plus a sweep plus the work, with room for a
#: loaded host, and far below the visibility timeout (3,600 s) that stranded them before.
ANSWER_WITHIN_S = 60


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP", "partition", "kill -9, stock consumer"])
def test_a_worker_killed_frozen_or_cut_off_holding_requests_another_answers_them(
        redis_db, tmp_path, fault: str) -> None:
    # Given two workers at the default settings, the first on a slow kernel (15 s a batch) and
    # talking to Redis through a link that can be cut (both on Celery's stock consumer, or both
    # on the fast one)
    url, r = redis_db.url, redis_db.client
    link = Partition(urlsplit(url).port or 6379)
    prefix, slow = crashy_env(url, "held", 15)
    stock = fault.endswith("stock consumer")
    if stock:
        slow["ASYNCINFER_CONSUMER"] = "celery"
    first, second = two_crashy_workers(link.url(redis_db.number), url, tmp_path, slow,
                                 {**slow, "CRASHY_SLEEP_S": "0.2"})
    client = Client(broker_url=url)
    try:
        # And 12 requests held by the first: a batch on its device, the others waiting
        futures = held_by_first(client, r, prefix, second.pid)
        # When the first is killed outright, frozen, or cut off from Redis
        struck = time.monotonic()
        if fault.startswith("kill -9"):
            first.process.kill()
            first.process.wait()
        elif fault == "SIGSTOP":
            os.kill(first.pid, signal.SIGSTOP)
        else:
            link.cut()
        # Then the second answers every one, within the lease and a sweep, not the hour; those
        # on the first's device ran once more each (together, on the fast consumer), the others
        # once
        answered_by_second(futures, r, prefix, struck, ANSWER_WITHIN_S, fault, together=not stock)
        if not fault.startswith("kill -9"):
            # When the worker wakes or the link heals, it learns that its leases went to another
            # worker; what it answers again keeps a valid final state
            os.kill(first.pid, signal.SIGCONT)
            link.heal()
            wait_for(lambda: "leased to another worker" in first.log(), 30, "the lost leases seen")
            # (what it had not started it gives up, when its renewal comes before its next batch)
            given_up = re.findall(r"gave up (\d+)", first.log())
            print(f"{fault}: the woken worker gave up {given_up}")
            for i in range(12):
                assert client.result(futures[i].id, timeout_s=30)["output"].tolist() == [[float(i)]]
    finally:
        client.close()
        for w in (first, second):
            if w.process.poll() is None:
                os.kill(w.pid, signal.SIGCONT)
        link.heal()
        # both at once, and before the link closes: the first stops through it (with the link
        # gone its stop waits on Redis until it is killed)
        stop_together([first, second])
        link.close()


@pytest.mark.timeout(180)
def test_a_worker_cut_off_past_its_lease_starts_nothing_more_and_gives_it_up_once_healed(
        redis_db, tmp_path) -> None:
    # Given two workers at the default settings, the first on an 8 s kernel and talking to Redis
    # through a link that can be cut, and 12 requests held by the first: a batch on its device,
    # the others waiting behind it
    url, r = redis_db.url, redis_db.client
    link = Partition(urlsplit(url).port or 6379)
    prefix, slow = crashy_env(url, "gate", 8)
    first, second = two_crashy_workers(link.url(redis_db.number), url, tmp_path, slow,
                                       {**slow, "CRASHY_SLEEP_S": "0.2"})
    client = Client(broker_url=url)
    try:
        futures = held_by_first(client, r, prefix, second.pid)
        # When the first is cut off from Redis, and its device frees during the cut (8 s: over
        # half the lease after the last renewal the first could make)
        struck = time.monotonic()
        link.cut()
        # Then the second answers every one after the lease: those on the first's device ran
        # once more, the others once
        answered_by_second(futures, r, prefix, struck, ANSWER_WITHIN_S, "a cut past the lease")
        on_device = set(crashy_batches(r, prefix)[0])
        wait_for(lambda: "the device waits" in first.log(), 30, "the first's device to wait")
        # When the link heals, the first learns its leases went to the second
        link.heal()
        wait_for(lambda: "leased to another worker" in first.log(), 30, "the lost leases seen")
        wait_for(lambda: sum(int(n) for n in re.findall(r"gave up (\d+)", first.log()))
                 == 12 - len(on_device), 30, "what waited behind the batch given up")
        stop_together([first])
        # Then what waited behind its batch never started there: each ran once, on the second
        starts = crashy_starts(r, prefix)
        assert starts == {i: 2 if i in on_device else 1 for i in range(12)}, starts
        report_counts("a worker cut off past its lease, then healed", 12, len(futures), starts,
                      time.monotonic() - struck)
    finally:
        client.close()
        link.heal()
        stop_together([first, second])
        link.close()


@pytest.mark.timeout(150)
def test_a_live_worker_on_a_kernel_longer_than_its_lease_keeps_its_request(redis_db, tmp_path) -> None:
    # Given two workers at the default settings (a 10 s lease), and a client that declares a
    # request lost after a few seconds without a trace of it
    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "long", 0)
    first, second = two_crashy_workers(url, url, tmp_path, env, env)
    client = Client(settings=Settings.from_env(broker_url=url, lost_after_s=4.0))
    try:
        # When one runs a 25 s kernel while the other idles beside it
        future = client.submit("crashy", crashy_index(1025))
        check = lost_check_of(client)
        answer = future.result(timeout=ANSWER_WITHIN_S)
        # Then it ran exactly once: its renewed lease kept it from the idle one's sweep
        assert answer["output"].tolist() == [[1025.0]] and crashy_starts(r, prefix) == {1025: 1}
        assert r.hlen(UNACKED_KEY) == 0 and r.zcard(LEASES_KEY) == 0
        # And the client, which looked for it all along, never declared it lost
        assert check.looks >= 25 / check.period_s - 2
        print(f"\n25 s kernel: ran once, declared lost 0, looks while it ran {check.looks}")
    finally:
        client.close()
        stop_together([first, second])


@pytest.mark.timeout(180)
def test_a_worker_killed_under_up_is_restarted_and_takes_back_what_it_held_at_once(
        redis_db, tmp_path) -> None:
    # Given `asyncinfer up` with one worker on a slow kernel (30 s a batch), holding 12 requests
    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "restart", 30)
    with crashy_under_up(url, env, tmp_path) as (client, seen):
        futures = [client.submit("crashy", crashy_index(i)) for i in range(12)]
        wait_for(lambda: r.hlen(UNACKED_KEY) == 12 and crashy_batches(r, prefix), 30,
                 "12 held, a batch on the device")
        # When it is killed outright (no other worker anywhere) and its device gets fast
        r.set(f"{prefix}:fast", 1)
        struck = time.monotonic()
        os.kill(seen[0], signal.SIGKILL)
        # Then the worker `up` starts in its place takes them back at once (not after the lease:
        # the dead process was of this host) and answers every one
        answers = [f.result(timeout=ANSWER_WITHIN_S) for f in futures]
        last_s = time.monotonic() - struck
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(12)]
        assert len({a.parameters["worker"] for a in answers}) == 1
        starts = crashy_starts(r, prefix)
        on_device = crashy_batches(r, prefix)[0]
        assert starts == {i: 2 if i in on_device else 1 for i in range(12)}
        report_counts("kill -9 of the one worker under up, restarted", 12, len(answers), starts, last_s)
        up_log = (tmp_path / "up.log").read_text(errors="replace")
        assert "took back 12 requests that a dead worker of this host held" in up_log, up_log[-3000:]


@pytest.mark.timeout(240)
def test_a_request_that_kills_its_worker_is_isolated_then_fails_with_worker_lost(
        redis_db, tmp_path) -> None:
    # Given `asyncinfer up` with one worker and a model that keeps its dead letters
    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "killer", 0.1)
    env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({"crashy": {"dead_letter": True}})
    with crashy_under_up(url, env, tmp_path) as (client, _):
        # When 40 good requests and one that kills its worker are sent in one burst, then every
        # good one is answered and the killer isolated, failed for good and kept as a dead letter
        killer_isolated(client, r, prefix, ANSWER_WITHIN_S, "asyncinfer up")


@pytest.mark.timeout(240)
def test_a_kernel_that_kills_its_worker_at_once_is_counted_against_its_batch_only(
        redis_db, tmp_path) -> None:
    # Given `asyncinfer up` with one worker whose model ends the process the moment a batch with
    # -2 starts (no round trip first: the device marks must already be on their way to Redis)
    url, r = redis_db.url, redis_db.client
    prefix, env = crashy_env(url, "at-once", 0.05)
    crashes = tmp_path / "crashes.jsonl"
    env["CRASHY_CRASH_LOG"] = str(crashes)
    with crashy_under_up(url, env, tmp_path) as (client, _):
        # When 8 good requests, the killer and 16 more are sent in one burst (batches of 8: the
        # killer's batch has a batch before it, and one formed after it)
        good, killer = burst_with_killer(client, 8, 16, killer=-2)
        sent_at = time.monotonic()
        answers = [f.result(timeout=ANSWER_WITHIN_S) for f in good]
        last_s = time.monotonic() - sent_at
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(24)]
        # Then the killer fails for good after exactly three deaths: each was counted, though the
        # process died microseconds after the launch (its batch; the rerun of that batch, as
        # suspects; then alone)
        with pytest.raises(WorkerLost, match="died 3 times"):
            killer.result(timeout=ANSWER_WITHIN_S)
        batches = [json.loads(line) for line in crashes.read_text().splitlines()]
        assert len(batches) == 3 and batches[2] == [-2] and -2 in batches[0]
        assert sorted(batches[1]) == sorted(batches[0])
        assert r.get(DEATHS_PREFIX + killer.id) == b"3"
        # And deaths counted against the good requests of the killer's batch, twice (the batch
        # and its rerun), and against no other: not the batch before it (done, perhaps not yet
        # acknowledged), not the next
        deaths = {i: int(r.get(DEATHS_PREFIX + f.id) or 0) for i, f in enumerate(good)}
        assert deaths == {i: 2 * int(i in batches[0]) for i in range(24)}
        report_counts("a kernel that kills its worker at once, among 24 (asyncinfer up)", 25,
                len(answers) + 1, crashy_starts(r, prefix), last_s)


@pytest.mark.timeout(150)
def test_leases_are_renewed_across_a_sentinel_failover(tmp_path, redis_url) -> None:
    # Given two workers on a Sentinel-managed Redis at the default settings, one running a 12 s
    # kernel (its starts counted on another Redis, which the failover leaves alone)
    group = SentinelGroup(tmp_path / "sentinel", replicas=1).start()
    url = group.url(db=0)
    prefix, env = crashy_env(redis_url, "failover", 0)
    counts = redis.Redis.from_url(redis_url)
    first, second = two_crashy_workers(url, url, tmp_path, env, env)
    client = Client(broker_url=url)
    try:
        future = client.submit("crashy", crashy_index(1012))
        wait_for(lambda: crashy_starts(counts, prefix), 30, "the request on a device")
        # When the master dies mid-kernel and Sentinel promotes the replica
        old = group.kill_master()
        group.wait_promoted(old)
        # Then the worker that runs it renews its lease on the new master: the idle one's sweep
        # never takes it, and it runs exactly once
        assert future.result(timeout=ANSWER_WITHIN_S)["output"].tolist() == [[1012.0]]
        assert crashy_starts(counts, prefix) == {1012: 1}
        report_counts("a Sentinel failover under a 12 s kernel", 1, 1, crashy_starts(counts, prefix), 0.0)
    finally:
        client.close()
        stop_together([first, second])
        group.stop()
        counts.close()
