"""Leases on a real Redis, without a worker: the take leases what it records, the holder renews,
the sweep puts back what expired (marked redelivered, at the front of its list), deaths count only
for what was on the device, and what a dead process of this host held comes back at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import redis

from asyncinfer.broker.leases import Leases, holder_of, is_dead_here
from asyncinfer.broker.store import StoreScript
from asyncinfer.broker.take import Taker
from asyncinfer.constants import PRIORITY_SEP, priority_lists
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.wire.keys import (
    DEATHS_PREFIX,
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)
from asyncinfer.wire.messages import task_message
from tests.support.databases import RedisDatabase
from tests.support.waiting import wait_for

QUEUE = "infer.m"


def _message(request_id: str) -> str:
    return task_message("asyncinfer.infer", request_id, {"model": "m", "inputs": []}, QUEUE)


def _leases(r: redis.Redis, held: list[str], lease_s: float = 1.0, node: str = "n@h") -> Leases:
    return Leases(r, r, node=node, lease_s=lease_s, deaths_ttl_s=60, count_deaths=True,
                  held=lambda: list(held))


def _tag(raw: bytes) -> str:
    return json.loads(raw)["properties"]["delivery_tag"]


@pytest.fixture()
def r(redis_db: RedisDatabase) -> redis.Redis:
    return redis_db.client


def test_the_take_leases_what_it_records_and_the_store_ends_the_lease(r) -> None:
    # Given two requests, one on a priority list
    r.lpush(QUEUE, _message("a"))
    r.lpush(f"{QUEUE}{PRIORITY_SEP}3", _message("b"))
    leases = _leases(r, [], lease_s=10)
    now_s = float(r.time()[0])
    # When a worker takes them with its lease terms
    taken = Taker(r).take(priority_lists([QUEUE]), 5, lease=leases.terms)
    # Then each is leased to it for about the lease, on Redis' clock, with the list it came from
    assert len(taken) == 2 and all(t[2] for t in taken) and [t[4] for t in taken] == [0, 0]
    for key, raw, *_ in taken:
        tag = _tag(raw)
        assert now_s + 9 <= float(r.zscore(LEASES_KEY, tag)) <= now_s + 12
        assert r.hget(LEASE_HOLDERS_KEY, tag).decode() == f"{leases.holder}\t{key}"
    # And storing a result ends the lease with the acknowledgement
    StoreScript(r, 60)([("celery-task-meta-a", "{}", "", _tag(taken[0][1]), "")])
    first = _tag(taken[0][1])
    assert r.zscore(LEASES_KEY, first) is None and not r.hexists(LEASE_HOLDERS_KEY, first)
    assert not r.hexists(UNACKED_KEY, first) and r.zcard(LEASES_KEY) == 1


def test_a_worker_s_store_ends_an_unleased_take_s_index_entry_and_a_leased_take_s_lease(r) -> None:
    # Given a worker's leased take of one request and an unleased take (kombu's index) of another
    r.lpush(QUEUE, _message("leased"))
    leases = _leases(r, [], lease_s=10)
    [(_, leased_raw, *_)] = Taker(r).take([QUEUE], 1, lease=leases.terms)
    r.lpush(QUEUE, _message("indexed"))
    [(_, indexed_raw, *_)] = Taker(r).take([QUEUE], 1)
    leased, indexed = _tag(leased_raw), _tag(indexed_raw)
    assert r.zscore(UNACKED_INDEX_KEY, indexed) is not None
    assert r.zscore(UNACKED_INDEX_KEY, leased) is None and r.zscore(LEASES_KEY, leased) is not None
    # When the worker (its holder name given) stores both results in one call
    store = StoreScript(r, 60, leases.holder)
    store([("celery-task-meta-leased", "{}", "", leased, ""),
           ("celery-task-meta-indexed", "{}", "", indexed, "")])
    # Then each is acknowledged where it was recorded: the index entry, the lease and its holder
    assert r.zcard(UNACKED_INDEX_KEY) == 0 and r.zcard(LEASES_KEY) == 0
    assert r.hlen(UNACKED_KEY) == 0 and r.hlen(LEASE_HOLDERS_KEY) == 0
    assert r.get("celery-task-meta-leased") == b"{}" and r.get("celery-task-meta-indexed") == b"{}"


def test_an_expired_lease_goes_back_to_the_front_of_its_list_marked_redelivered(r) -> None:
    # Given a request taken under a 1 s lease whose holder never renews, and one queued after it
    r.lpush(f"{QUEUE}{PRIORITY_SEP}3", _message("held"))
    [(key, raw, *_)] = Taker(r).take(priority_lists([QUEUE]), 1, lease=_leases(r, []).terms)
    r.lpush(key, _message("later"))
    sweeper = _leases(r, [], node="other@h")
    assert sweeper.sweep() == 0  # not expired yet: nothing goes back
    # When its lease expires and another worker sweeps
    wait_for(lambda: sweeper.sweep() == 1, 10, "the expired lease swept", poll_s=0.1)
    # Then it is back on the list it came from, next to be taken, marked as kombu marks it
    back = json.loads(r.lindex(key, -1))
    assert back["headers"]["id"] == "held" and back["headers"]["redelivered"] is True
    assert back["properties"]["delivery_info"]["redelivered"] is True
    assert json.loads(r.lindex(key, 0))["headers"]["id"] == "later"
    # And nothing of it is left unacknowledged or leased; no death was counted (not on a device)
    tag = _tag(raw)
    assert not r.hexists(UNACKED_KEY, tag) and r.zscore(UNACKED_INDEX_KEY, tag) is None
    assert r.zcard(LEASES_KEY) == 0 and r.hlen(LEASE_HOLDERS_KEY) == 0
    assert r.get(DEATHS_PREFIX + "held") is None and sweeper.reclaimed == 1


def test_a_renewing_holder_keeps_its_lease_and_learns_when_another_took_it(r) -> None:
    r.lpush(QUEUE, _message("kept"))
    held: list[str] = []
    holder = _leases(r, held)
    [(_, raw, *_)] = Taker(r).take([QUEUE], 1, lease=holder.terms)
    held.append(_tag(raw))
    sweeper = _leases(r, [], node="other@h")
    # When the holder renews for three lease lengths while another sweeps
    for _ in range(6):
        assert holder.renew() == []
        assert sweeper.sweep() == 0
        time.sleep(0.5)
    # Then it still holds it: nothing went back
    assert r.llen(QUEUE) == 0 and r.hexists(UNACKED_KEY, held[0])
    # When another worker's take holds the same tag (a lease it lost while frozen)
    r.hset(LEASE_HOLDERS_KEY, held[0], f"{sweeper.holder}\t{QUEUE}")
    # Then the renewal says so, and leaves the other's lease alone
    assert holder.renew() == held and holder.lost == 1


def test_a_holder_takes_again_what_redis_forgot_and_not_what_went_back_to_its_queue(r) -> None:
    # Given two requests a worker holds (taken, leased), and a third swept from under it while
    # it was frozen past its lease
    for rid in ("forgotten", "swept"):
        r.lpush(QUEUE, _message(rid))
    held: list[str] = []
    forgotten: list[list[str]] = []
    holder = Leases(r, r, node="n@h", lease_s=1.0, deaths_ttl_s=60, count_deaths=True,
                    held=lambda: list(held), on_forgotten=forgotten.append)
    taken = Taker(r).take([QUEUE], 2, lease=holder.terms)
    tags = {json.loads(raw)["headers"]["id"]: _tag(raw) for _, raw, *_ in taken}
    entries = {tag: r.hget(UNACKED_KEY, tag) for tag in tags.values()}
    held += tags.values()
    sweeper = _leases(r, [], node="other@h")
    wait_for(lambda: sweeper.sweep() == 2, 10, "both leases swept", poll_s=0.1)
    r.delete(QUEUE)  # both back on the queue; say another worker took and answered "swept"
    # When Redis forgets the other (restarted without its data): not on its queue, no holder, no
    # mark that it went back
    r.delete("asyncinfer:reclaimed:" + tags["forgotten"])
    # Then the renewal tells the forgotten one apart from the one that went back
    assert holder.renew() == [tags["swept"]] and holder.lost == 1
    assert forgotten == [[tags["forgotten"]]]
    held.remove(tags["swept"])  # the worker gives it up (it runs where it went)
    # And the holder leases it again as the take had: holder, lease, kombu's entry
    tag = tags["forgotten"]
    assert holder.adopt([(tag, QUEUE, entries[tag].decode())]) == [tag] and holder.adopted == 1
    assert r.hget(LEASE_HOLDERS_KEY, tag).decode() == f"{holder.holder}\t{QUEUE}"
    assert r.zscore(LEASES_KEY, tag) is not None and r.hget(UNACKED_KEY, tag) == entries[tag]
    # And the next renewal keeps it; if the holder dies, the sweep puts it back on its queue
    assert holder.renew() == [] and forgotten == [[tag]]
    wait_for(lambda: sweeper.sweep() == 1, 10, "the lease taken again swept", poll_s=0.1)
    assert [json.loads(m)["headers"]["id"] for m in r.lrange(QUEUE, 0, -1)] == ["forgotten"]
    # And a message that went back, or another holds, is never leased again
    assert holder.adopt([(tags["swept"], QUEUE, entries[tags["swept"]].decode())]) == []
    r.hset(LEASE_HOLDERS_KEY, "t-other", f"{sweeper.holder}\t{QUEUE}")
    assert holder.adopt([("t-other", QUEUE, "[]")]) == []
    assert r.hget(LEASE_HOLDERS_KEY, "t-other").decode().startswith(sweeper.holder)


def test_a_death_counts_only_against_what_was_on_the_device_and_the_take_reads_it(r) -> None:
    for rid in ("on-device", "waiting"):
        r.lpush(QUEUE, _message(rid))
    dead = _leases(r, [])
    taken = Taker(r).take([QUEUE], 2, lease=dead.terms)
    ids = {json.loads(raw)["headers"]["id"]: _tag(raw) for _, raw, *_ in taken}
    dead.on_device([(ids["on-device"], "on-device", WorkItem(request=None, rows=1, signature=(),
                                                             on_device=True))])
    dead.device_marks.sync()  # the marks go without waiting for Redis
    assert r.hget(LEASE_DEVICE_KEY, ids["on-device"]) == b"on-device"
    sweeper = _leases(r, [], node="other@h")
    wait_for(lambda: sweeper.sweep() == 2, 10, "both leases swept", poll_s=0.1)
    assert sweeper.deaths_counted == 1 and r.get(DEATHS_PREFIX + "on-device") == b"1"
    assert r.get(DEATHS_PREFIX + "waiting") is None and r.hlen(LEASE_DEVICE_KEY) == 0
    # The next take reads the count of each request it takes
    again = Taker(r).take([QUEUE], 2, lease=sweeper.terms)
    deaths = {json.loads(raw)["headers"]["id"]: died for _, raw, _, _, died in again}
    assert deaths == {"on-device": 1, "waiting": 0}


def test_what_a_dead_process_of_this_host_held_comes_back_at_once_a_live_ones_does_not(r) -> None:
    # Given a request leased (for a long time) to a process of this host that has exited, and one
    # leased to a process that still runs
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_holder, live_holder = holder_of("w@h", gone.pid), holder_of("w@h", alive.pid)
        for rid, holder in (("of-the-dead", dead_holder), ("of-the-living", live_holder)):
            r.lpush(QUEUE, _message(rid))
            taker = _leases(r, [], lease_s=600)
            taker.holder = holder
            Taker(r).take([QUEUE], 1, lease=taker.terms)
        assert is_dead_here(dead_holder) and not is_dead_here(live_holder)
        # When a worker starts on this host
        restarted = _leases(r, [], lease_s=600, node="w@h")
        # Then the dead one's request is back on its queue at once; the living one's is not
        assert restarted.take_back_dead() == 1
        assert [json.loads(m)["headers"]["id"] for m in r.lrange(QUEUE, 0, -1)] == ["of-the-dead"]
        assert r.hlen(LEASE_HOLDERS_KEY) == 1 and r.hlen(UNACKED_KEY) == 1
    finally:
        alive.kill()
        alive.wait()


def test_a_batch_off_the_device_is_unmarked_with_the_next_batchs_marks(r) -> None:
    leases = _leases(r, [])
    done = WorkItem(request=None, rows=1, signature=(), on_device=True)
    leases.on_device([("t-done", "r-done", done)])
    leases.device_marks.sync()
    assert r.hgetall(LEASE_DEVICE_KEY) == {b"t-done": b"r-done"}
    # When its batch comes off the device and the next goes on
    done.on_device = False
    nxt = WorkItem(request=None, rows=1, signature=(), on_device=True)
    leases.on_device([("t-next", "r-next", nxt)])
    leases.device_marks.sync()
    # Then a death from now on counts against the batch on the device only
    assert r.hgetall(LEASE_DEVICE_KEY) == {b"t-next": b"r-next"}


def test_a_sweeper_that_marks_nothing_itself_still_counts_the_deaths_of_others(r) -> None:
    # Given a request marked on the device of a holder that died
    r.lpush(QUEUE, _message("killer"))
    dead = _leases(r, [])
    [(_, raw, *_)] = Taker(r).take([QUEUE], 1, lease=dead.terms)
    dead.on_device([(_tag(raw), "killer", WorkItem(request=None, rows=1, signature=(),
                                                   on_device=True))])
    dead.device_marks.sync()
    # When a sweeper that counts no deaths of its own (Celery's consumer's) puts it back
    stock = Leases(r, r, node="stock@h", lease_s=1.0, deaths_ttl_s=60, count_deaths=False,
                   held=list)
    wait_for(lambda: stock.sweep() == 1, 10, "the expired lease swept", poll_s=0.1)
    # Then the death counts all the same
    assert r.get(DEATHS_PREFIX + "killer") == b"1" and stock.deaths_counted == 1


def test_a_late_holder_acknowledges_and_restores_only_what_it_still_holds(r) -> None:
    from asyncinfer.broker.restore import restore
    from asyncinfer.wire.keys import RECLAIMED_PREFIX

    # Given four requests a worker took under its lease: one another worker holds now (its lease
    # lapsed here, swept, taken there), one a sweep put back and nobody took yet, one still its
    # own, one Redis forgot (no holder, no mark)
    rids = ("taken_there", "put_back", "mine", "forgotten")
    for rid in rids:
        r.lpush(QUEUE, _message(rid))
    late = _leases(r, [])
    taken = Taker(r).take([QUEUE], 4, lease=late.terms)
    tags = {json.loads(raw)["headers"]["id"]: _tag(raw) for _, raw, *_ in taken}
    other = _leases(r, [], node="other@h")
    r.hset(LEASE_HOLDERS_KEY, tags["taken_there"], f"{other.holder}\t{QUEUE}")
    r.hdel(LEASE_HOLDERS_KEY, tags["put_back"], tags["forgotten"])
    r.set(RECLAIMED_PREFIX + tags["put_back"], "1")
    # When the late worker gives them all back (a stop), a death counted against each
    back = restore(r, [(tags[rid], QUEUE, _message(rid), rid) for rid in rids],
                   holder=late.holder, deaths_ttl_s=60)
    # Then only its own and the forgotten go back on the queue, with a death each; the other
    # holder's bookkeeping is untouched
    assert back == 2
    assert sorted(json.loads(m)["headers"]["id"] for m in r.lrange(QUEUE, 0, -1)) == \
        ["forgotten", "mine"]
    assert [r.get(DEATHS_PREFIX + rid) for rid in rids] == [None, None, b"1", b"1"]
    assert r.hget(LEASE_HOLDERS_KEY, tags["taken_there"]).decode().startswith(other.holder)
    assert r.hexists(UNACKED_KEY, tags["taken_there"])
    assert not r.hexists(UNACKED_KEY, tags["mine"])
    assert not r.hexists(LEASE_HOLDERS_KEY, tags["mine"])

    # When the late worker stores results of the one the other holds and of one it holds
    r.lpush(QUEUE, _message("mine_too"))
    [(_, raw, *_)] = Taker(r).take([QUEUE], 1, lease=late.terms)
    mine_too = _tag(raw)
    r.delete(QUEUE)
    store = StoreScript(r, 60, late.holder)
    store([("celery-task-meta-taken_there", "{}", "", tags["taken_there"], ""),
           ("celery-task-meta-mine_too", "{}", "", mine_too, "")])
    # Then both results are stored, its own is acknowledged, the other's lease and unacked entry
    # are left to the other holder
    assert r.get("celery-task-meta-taken_there") == b"{}"
    assert r.get("celery-task-meta-mine_too") == b"{}"
    assert not r.hexists(UNACKED_KEY, mine_too) and r.zscore(LEASES_KEY, mine_too) is None
    assert r.hexists(UNACKED_KEY, tags["taken_there"])
    assert r.zscore(LEASES_KEY, tags["taken_there"]) is not None
    # And a store with no holder named acknowledges whoever holds
    StoreScript(r, 60)([("celery-task-meta-taken_there", "{}", "", tags["taken_there"], "")])
    assert not r.hexists(UNACKED_KEY, tags["taken_there"])
