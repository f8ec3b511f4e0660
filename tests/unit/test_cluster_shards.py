"""The shards of a fleet on a Redis Cluster: their tags, the URL form, and the
key arguments a shard's connections put its tag before (a COMMAND table as Redis 6 and 7 give it)."""

from __future__ import annotations

from collections import Counter

import pytest
import redis
from redis.crc import key_slot

from asyncinfer.broker.cluster_keys import KeyTable, prefixed_command, unprefixed
from asyncinfer.broker.shards import SLOTS, key_prefix, request_shard, shard_tags, tag_slot
from asyncinfer.broker.urls import is_cluster_url, parse_cluster_url, pinned_url, shard_urls

P = b"{3.48}"

#: Entries of a COMMAND reply: Redis 6's seven fields, and Redis 7's with subcommands.
_TABLE = [
    [b"get", 2, [b"readonly"], 1, 1, 1, []],
    [b"set", -3, [b"write"], 1, 1, 1, []],
    [b"mset", -3, [b"write"], 1, -1, 2, []],
    [b"del", -2, [b"write"], 1, -1, 1, []],
    [b"brpop", -3, [b"write", b"blocking"], 1, -2, 1, []],
    [b"publish", 3, [b"pubsub"], 0, 0, 0, []],
    [b"wait", 3, [], 0, 0, 0, []],
    [b"evalsha", -3, [b"noscript", b"movablekeys"], 0, 0, 0, []],
    [b"xread", -4, [b"readonly", b"movablekeys"], 0, 0, 0, []],
    [b"georadius", -6, [b"write", b"movablekeys"], 1, 1, 1, []],
    [b"object", -2, [], 0, 0, 0, [], [], [], [[b"object|encoding", 3, [b"readonly"], 2, 2, 1]]],
    [b"zunionstore", -4, [b"write", b"movablekeys"], 1, 1, 1, []],
]


def test_each_shard_has_a_slot_of_its_own_range_so_masters_with_equal_ranges_hold_equal_shares() -> None:
    tags = shard_tags(12)
    slots = [tag_slot(t) for t in tags]
    assert len(set(tags)) == 12
    for i, slot in enumerate(slots):
        assert i * SLOTS // 12 <= slot < (i + 1) * SLOTS // 12
        assert slot == key_slot(key_prefix(tags[i]) + b"infer.minilm")  # the tag places the key
    masters = Counter(slot * 3 // SLOTS for slot in slots)  # three masters, equal ranges
    assert masters == {0: 4, 1: 4, 2: 4}
    with pytest.raises(ValueError, match="1 to 16384"):
        shard_tags(0)


def test_the_cluster_url_form() -> None:
    url = parse_cluster_url("rediscluster://user:p%40ss@10.0.0.1:7000/?nodes=10.0.0.2:7001,[::1]:7002"
                            "&shards=6")
    assert url.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    assert (url.shards, url.tls, url.username, url.password) == (6, False, "user", "p@ss")
    assert parse_cluster_url("redisclusters://h:7000").tls is True
    assert parse_cluster_url("rediscluster://h:7000/0").shards == 1
    sharded = parse_cluster_url("rediscluster://h:7000/?shards=12&shard=5")
    assert (sharded.shards, sharded.shard) == (12, 5)
    assert is_cluster_url("rediscluster://h:1") and not is_cluster_url("redis://h:1")
    for bad, rule in (("rediscluster://", "host:port expected"), ("rediscluster://h", "host:port"),
                      ("rediscluster://h:1,g:2", r"\?nodes="), ("rediscluster://h:1/2", "one database"),
                      ("rediscluster://h:1?shards=0", "1 to 16384"),
                      ("rediscluster://h:1?nodes=g", "node 'g'"),
                      ("rediscluster://h:1?db=2", "'nodes', 'shards' and 'shard'"),
                      ("rediscluster://h:1?shard=1", r"0 to shards - 1 \(0\), got 1"),
                      ("rediscluster://h:1?shards=3&shard=x", "shard must be a number"),
                      ("redis://h:1", "starts with rediscluster")):
        with pytest.raises(ValueError, match=rule):
            parse_cluster_url(bad)


def test_keys_get_the_shard_s_tag_and_nothing_else_does() -> None:
    table = KeyTable(_TABLE)
    assert prefixed_command(("GET", "k"), P, table) == ("GET", P + b"k")
    assert prefixed_command(("MSET", "a", "1", "b", "2"), P, table) == (
        "MSET", P + b"a", "1", P + b"b", "2")
    assert prefixed_command(("BRPOP", "q1", b"q2", 5), P, table) == ("BRPOP", P + b"q1", P + b"q2", 5)
    assert prefixed_command(("PUBLISH", "chan", "v"), P, table) == ("PUBLISH", "chan", "v")
    assert prefixed_command(("WAIT", 1, 100), P, table) == ("WAIT", 1, 100)
    assert prefixed_command(("DEL", "a", ""), P, table) == ("DEL", P + b"a", P)  # "none": in the slot
    assert prefixed_command(("EVALSHA", "sha", 2, "k1", "k2", "arg"), P, table) == (
        "EVALSHA", "sha", 2, P + b"k1", P + b"k2", "arg")
    assert prefixed_command(("XREAD", "COUNT", 5, "STREAMS", "s1", "s2", "0", "0"), P, table) == (
        "XREAD", "COUNT", 5, "STREAMS", P + b"s1", P + b"s2", "0", "0")
    assert prefixed_command(("OBJECT", "ENCODING", "k"), P, table) == ("OBJECT", "ENCODING", P + b"k")
    assert prefixed_command(("ZUNIONSTORE", "d", 2, "a", "b", "WEIGHTS", 1, 2), P, table) == (
        "ZUNIONSTORE", P + b"d", 2, P + b"a", P + b"b", "WEIGHTS", 1, 2)
    assert prefixed_command(("KEYS", "asyncinfer:*"), P, table) == ("KEYS", P + b"asyncinfer:*")
    assert prefixed_command(("SCAN", 0, "MATCH", "x*", "COUNT", 10), P, table) == (
        "SCAN", 0, "MATCH", P + b"x*", "COUNT", 10)
    assert prefixed_command(("SCAN", 0), P, table) == ("SCAN", 0, b"MATCH", P + b"*")


def test_commands_a_shard_cannot_place_are_refused_by_name() -> None:
    table = KeyTable(_TABLE)
    for args, named in ((("FLUSHDB",), "FLUSHDB"), (("GEORADIUS", "k", 0, 0, 1, "m"), "GEORADIUS"),
                        (("NOSUCH", "k"), "NOSUCH"), (("MIGRATE", "h", 1, "k", 0, 1), "MIGRATE")):
        with pytest.raises(redis.DataError, match=named):
            prefixed_command(args, P, table)


def test_replies_that_name_keys_lose_the_tag() -> None:
    assert unprefixed("BRPOP", [P + b"q1", b"msg"], P) == [b"q1", b"msg"]
    assert unprefixed("BRPOP", None, P) is None
    assert unprefixed("KEYS", [P + b"a", P + b"b"], P) == [b"a", b"b"]
    assert unprefixed("SCAN", [b"0", [P + b"a"]], P) == [b"0", [b"a"]]
    assert unprefixed("XREAD", [[P + b"s", [[b"1-0", [b"f", b"v"]]]]], P) == [
        [b"s", [[b"1-0", [b"f", b"v"]]]]]
    assert unprefixed("XREAD", {P + b"s": [[b"1-0", [b"f", b"v"]]]}, P) == {
        b"s": [[b"1-0", [b"f", b"v"]]]}
    assert unprefixed("KEYS", ["{3.48}a"], P) == ["a"]  # a client that decodes replies


def test_key_names_outside_key_arguments_are_placed_by_the_client_s_keyspace() -> None:
    from asyncinfer.broker.cluster_client import shard_client
    from asyncinfer.broker.keyspace import PLAIN, Keyspace, keyspace

    shard = shard_client("rediscluster://127.0.0.1:1/?shards=3&shard=1")  # connects on first use
    tag = "{" + shard_tags(3)[1] + "}"
    space = keyspace(shard)
    assert space == Keyspace(tag) and keyspace(shard.pipeline()) == space
    assert space.key("infer.m") == tag + "infer.m"
    assert space.key(b"celery-task-meta-1") == tag.encode() + b"celery-task-meta-1"
    assert space.name(tag + "infer.m") == "infer.m" and space.name(b"other") == "other"
    assert space.key(space.name(tag + "x")) == space.key(space.name("x")) == tag + "x"
    assert keyspace(redis.Redis()) is PLAIN and PLAIN.key("k") == "k" and PLAIN.name(b"k") == "k"
    shard.close()


def test_a_url_with_shards_and_no_shard_spreads_requests_over_all_of_them() -> None:
    spread = "rediscluster://h:7000/?nodes=g:7001&shards=3"
    assert parse_cluster_url(spread).spread is True
    assert parse_cluster_url(spread + "&shard=1").spread is False
    assert parse_cluster_url("rediscluster://h:7000").spread is False  # one shard: nothing to spread
    assert shard_urls(spread) == [f"{spread}&shard={k}" for k in range(3)]
    assert [parse_cluster_url(u).shard for u in shard_urls(spread)] == [0, 1, 2]
    assert shard_urls(spread + "&shard=2") == [spread + "&shard=2"]  # a pinned URL is its own
    assert shard_urls("redis://h:6379/0") == ["redis://h:6379/0"]
    assert pinned_url("rediscluster://h:1/?shards=4&shard=1#x", 3) == (
        "rediscluster://h:1/?shards=4&shard=3#x")


def test_a_request_s_shard_is_the_one_whose_slots_hold_its_id_s_slot() -> None:
    ids = [f"request-{i}" for i in range(9000)]
    shards = [request_shard(i, 3) for i in ids]
    assert shards == [key_slot(i.encode()) * 3 // SLOTS for i in ids]
    assert all(request_shard(i, 1) == 0 for i in ids[:50])
    counts = Counter(shards)
    assert sorted(counts) == [0, 1, 2] and all(2800 < n < 3200 for n in counts.values()), counts
