"""Waking an idle consumer when a request arrives, without taking the request.

A blocking pop (BRPOP, kombu's way) hands a message to the worker before the worker has recorded
it as unacknowledged: a worker killed in between loses it. Redis has no command that blocks until
one of several lists is non-empty without popping, but ``BLMOVE list list RIGHT RIGHT`` on a single
list does exactly that: it blocks while the list is empty and then moves the tail element onto the
tail of the same list — a no-op, done atomically. When it returns, the consumer wakes and takes
with the atomic take script (take.py). Nothing ever leaves a queue except through that
script, whoever the producer is (our client, Celery's ``send_task``, ``redis-cli``, another
language), so a request is at all times either on its queue or in kombu's unacknowledged
bookkeeping.

The caller itself waits on the first list (its main queue, where nearly all requests arrive)
on a connection of its own, so the common wake-up costs no thread hand-off (each hand-off waits
for the GIL, which a busy device thread holds); a thread per other list (priority lists, other
queues), each with its own connection, waits on that list. A push must not wake every idle worker
of a fleet (BLMOVE of a list onto itself leaves it non-empty, so Redis serves every client blocked
on it: N takes for one request, N − 1 of them empty). So, for every list, at most one consumer of
the fleet *watches* it — it holds ``asyncinfer:watch:<list>`` (a token with a short TTL, renewed
while it waits) and blocks on it with BLMOVE — and no other consumer blocks on that list. An idle
consumer that does not watch its first list waits instead, in one BLPOP on the caller's
connection, for the bells (``asyncinfer:bell:<list>``) of its first list and of every other list it
does not watch, counted in each one's ``…:waiters``; a thread whose list another consumer watches
blocks on nothing, and claims the watch when its block's time (:attr:`Waker.block_s`) passes or
when the caller claims it for it (each claim of the first list's watch takes, in the same round
trip, every watch of the consumer's lists that nobody holds).

When others wait, a watcher's take passes its watches on: it gives up the watch of the first list
and of each list whose thread fired (a list whose thread still blocks on it stays watched, by that
thread), and rings one bell, waking exactly one other idle consumer, which takes what came
meanwhile and claims what is free at its next wait. Alone, it keeps its watches (no round trip to
claim them again). A take that fills its room and leaves messages rings a bell too (take.py). A
thread that fires while its consumer is busy (taking, or full) passes its list's watch on and rings
its bell itself when others wait, so an idle consumer takes what came. A watcher that dies or
freezes holds its token until its TTL passes. Whatever happens, every idle consumer takes at least
once per wait (about a second): that is the longest a message waits on a list nobody blocks on (a
dead watcher's; or one whose watcher is busy while the only idle consumer blocks on its own first
list, where it hears no bell).

A watcher thread that fires sets the wake-up flag and, if the caller is blocked in Redis, cuts
that block short with ``CLIENT UNBLOCK``; it waits until the consumer is idle again
(:meth:`Waker.arm`) before it blocks again, otherwise it would spin on a list that is not empty.
Redis older than 6.2 has no BLMOVE: ``BRPOPLPUSH list list`` is used instead (it moves the oldest
message to the front of its list, which changes the order of that one message, never loses it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from asyncinfer.backoff import Backoff
from asyncinfer.broker.wake_scripts import CLAIM, CLAIM_FREE, PASS, RELEASE, WAITING
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.keys import BELL_PREFIX, WAITERS_SUFFIX, WATCH_PREFIX

__all__ = ["Waker"]

log = logging.getLogger(__name__)


class _Watch:
    """One watched list, as its consumer sees it."""

    __slots__ = ("list", "watch_key", "bell_key", "waiters_key", "until", "holds", "fired",
                 "fired_at", "called")

    def __init__(self, key: str) -> None:
        self.list = key
        self.watch_key = WATCH_PREFIX + key
        self.bell_key = BELL_PREFIX + key
        self.waiters_key = self.bell_key + WAITERS_SUFFIX
        #: Until when (monotonic) this consumer surely still holds the watch it claimed: no round
        #: trip to claim it again before then (its take says when it gave it up).
        self.until = 0.0
        #: Whether this consumer holds the watch, as last seen (it then waits for no bell of it).
        self.holds = False
        #: (a watcher thread's list) it fired, and blocks again once the consumer is idle again
        #: (a generation of :meth:`Waker.arm` after ``fired_at``).
        self.fired = False
        self.fired_at = 0
        #: (a watcher thread's list) set when the caller claimed the watch for the thread, or
        #: the waker closes: the thread looks again now.
        self.called = threading.Event()


class Waker:
    """Watches ``lists``; :meth:`wait` returns once one of them may hold a message.

    ``own`` is a single-connection client (``single_connection_client=True``) on which
    :meth:`wait` blocks on ``lists[0]``, or waits for bells; ``client`` gives the watcher threads
    of the other lists a connection each. Neither may have a socket timeout shorter than
    ``block_s``.
    """

    #: How long a watcher that fired keeps trying to cut the caller's block short (seconds).
    unblock_for_s = 0.2
    #: How long one blocking command of a watcher lasts (seconds): between two looks at stopping.
    block_s = 5

    #: How long a watcher's token outlives its wait (seconds): a dead watcher's passes this late.
    watch_margin_s = 2

    def __init__(self, client: redis.Redis, own: redis.Redis, lists: Sequence[str], *,
                 block_s: int | None = None, stopping: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.own = own
        self.lists = list(lists)
        if block_s is not None:
            self.block_s = block_s
        self._stopping = stopping or (lambda: False)
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._generation = 0
        self._idle = False  # from arm() to clear(): the consumer waits, or is about to
        self._rotate = False  # BRPOPLPUSH instead of BLMOVE (Redis < 6.2)
        self._blocking = False  # the caller is in (or about to send) its blocking command
        self._own_id: int | None = None
        self._watches = [_Watch(key) for key in self.lists]
        self._threads = [vital_thread(self._watch, f"asyncinfer-wake-{i}", self._watches[i])
                         for i in range(1, len(self.lists))]
        #: This consumer's watch token (the take script passes the watches on with it).
        self.token = os.urandom(8).hex()
        self._claim = client.register_script(CLAIM)
        self._claim_free = client.register_script(CLAIM_FREE)
        self._waiting = client.register_script(WAITING)
        self._pass = client.register_script(PASS)
        self._release = client.register_script(RELEASE)

    def start(self) -> Waker:
        connection = getattr(self.own, "connection", None)
        if connection is not None:  # a reconnect gets a new client ID: learn it each time
            connection.register_connect_callback(self._on_own_connect)
        try:
            self._own_id = int(self.own.client_id())
        except redis.RedisError as exc:  # learnt on the next connect
            log.warning("could not learn the consumer's Redis client ID (%s)", exc)
        for thread in self._threads:
            thread.start()
        return self

    def clear(self) -> None:
        """Forget earlier wake-ups: call it just before taking, so none that follows is lost."""
        self._idle = False
        self._wake.clear()

    def arm(self) -> None:
        """The consumer is idle: every watcher that fired blocks on its list again."""
        with self._cond:
            self._idle = True
            self._generation += 1
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Cut the consumer's wait short now (it has something else to do); if Redis fails, its
        wait ends by itself within about a second."""
        self._wake.set()
        try:
            self._unblock()
        except redis.RedisError as exc:
            log.debug("could not cut the consumer's wait short (%s)", exc)

    def wait(self, timeout_s: float) -> bool:
        """Block until a watched list had a message since :meth:`clear` (True), or about
        ``timeout_s`` (whole seconds in Redis, at least 1)."""
        self._blocking = True
        try:
            if self._wake.is_set() or self._done():
                return True
            try:
                block_s = max(1, round(timeout_s))
                if self._watching(block_s):
                    found = self._block(self.own, self.lists[0], block_s)
                else:  # another idle consumer watches: wait for its bell (or another's)
                    found = self._wait_for_bells(block_s)
            except Exception:
                if self._done():
                    return True  # close() cut the connection
                raise
            return found is not None or self._wake.is_set()
        finally:
            self._blocking = False

    def passable(self) -> tuple[int, ...]:
        """The positions (in ``lists``) of the lists whose watch this consumer's take may pass
        on: the first (the caller blocks on it only while it waits) and each other one whose
        watcher thread fired and waits for the consumer to be idle again. A list whose thread
        still blocks on it is never passed: it stays the one consumer blocked on it."""
        watches = self._watches
        return (0, *[i for i in range(1, len(watches)) if watches[i].fired])

    def watch_passed(self, positions: Sequence[int] = (0,)) -> None:
        """This consumer's take gave the watches of the lists at ``positions`` up."""
        for position in positions:
            w = self._watches[position]
            w.until = 0.0
            w.holds = False

    def _watching(self, block_s: int) -> bool:
        """Whether this consumer watches its first list for the next ``block_s`` seconds: it
        held the watch recently enough, or it claims (or renews) it now. The same round trip
        claims the watch of each other list nobody holds, for that list's thread."""
        now = time.monotonic()
        first = self._watches[0]
        if now < first.until:
            return True
        free = [w for w in self._watches[1:] if not w.holds]
        held = self._claim_free(
            keys=[first.watch_key, *[w.watch_key for w in free]], client=self.own,
            args=[self.token, (block_s + self.watch_margin_s) * 1000,
                  (self.block_s + self.watch_margin_s) * 1000])
        # sure for a little less than a watch lives, less the block that follows
        sure = now + self.watch_margin_s - 0.5
        for w, mine in zip(free, held[1:], strict=True):
            if mine and not w.holds:
                w.until = sure
                w.holds = True
                w.called.set()  # its thread blocks on the list now
        first.holds = bool(held[0])
        first.until = sure if first.holds else 0.0
        return first.holds

    def _wait_for_bells(self, block_s: int) -> Any:
        """Wait for a bell: the first list's, and that of every other list this consumer does
        not watch (one BLPOP), counted among each one's waiters (so that its watcher passes the
        watch)."""
        bells = [self._watches[0], *[w for w in self._watches[1:] if not w.holds]]
        counts = [w.waiters_key for w in bells]
        self._waiting(keys=counts, client=self.own, args=[1])
        try:
            return self.own.blpop([w.bell_key for w in bells], block_s)
        finally:
            try:
                self._waiting(keys=counts, client=self.own, args=[-1])
            except redis.RedisError:  # the counts lapse by themselves
                pass

    def close(self) -> None:
        """Stop the watchers (their blocked commands are cut by closing the connections) and give
        up the watches this consumer holds, so that whoever waits on its lists next (a restarted
        worker, this worker's new queues) watches them at once: a watch left to lapse kept a
        successor from blocking on a list other than its first for up to ``block_s`` +
        ``watch_margin_s``, and a message there waited up to a second for the successor's
        periodic take."""
        self._closed.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        for w in self._watches:
            w.called.set()
        try:
            self._release(keys=[w.watch_key for w in self._watches], args=[self.token])
        except redis.RedisError as exc:  # they lapse by themselves
            log.debug("could not give up the watches (%s)", exc)
        for client in (self.client, self.own):
            try:
                client.connection_pool.disconnect()
            except Exception:  # noqa: BLE001 - closing anyway
                pass

    def _on_own_connect(self, connection: Any) -> None:
        connection.send_command("CLIENT", "ID")
        self._own_id = int(connection.read_response())

    def _unblock(self) -> None:
        """Cut the caller's blocking command short, if it is in one (it may be on its way to
        Redis: try again for a moment, until it has returned)."""
        deadline = time.monotonic() + self.unblock_for_s
        while self._blocking and self._own_id is not None and not self._done():
            if self.client.client_unblock(self._own_id) or time.monotonic() > deadline:
                return
            time.sleep(0.002)

    def _done(self) -> bool:
        return self._closed.is_set() or self._stopping()

    def _watch(self, w: _Watch) -> None:
        """A watcher thread: while this consumer holds the watch of its list, block on the list;
        else wait until the caller claims it for this thread, or a block's time passes (and
        claim it then, if nobody holds it)."""
        backoff = Backoff()
        lifetime_ms = (self.block_s + self.watch_margin_s) * 1000
        while not self._done():
            if w.fired:
                with self._cond:
                    while self._generation == w.fired_at and not self._done():
                        self._cond.wait()
                w.fired = False
            try:
                now = time.monotonic()
                if now < w.until or self._claim(keys=[w.watch_key], client=self.client,
                                                args=[self.token, lifetime_ms]):
                    if now >= w.until:
                        w.until = now + self.watch_margin_s - 0.5
                    w.holds = True
                    found = self._block(self.client, w.list, self.block_s)
                    backoff.reset()
                    if found is not None:
                        self._fire(w)
                    continue
                w.holds = False
                w.until = 0.0
                backoff.reset()
                w.called.wait(self.block_s)
                w.called.clear()
            except Exception as exc:  # noqa: BLE001 - Redis errors, or a socket closed under it
                if self._done():
                    return  # close() cut the connection
                if w.fired:
                    continue  # it fired; only cutting the caller's block short failed
                wait_s = backoff.failed()
                log.warning("watching %s failed (%s: %s); again in %.1f s", w.list,
                            type(exc).__name__, exc, wait_s)
                self._closed.wait(wait_s)

    def _fire(self, w: _Watch) -> None:
        """A message came on ``w``'s list: wake the consumer. If it is busy, an idle one should
        take the message: pass the watch on when others wait for it."""
        with self._cond:
            w.fired_at = self._generation
        w.fired = True
        self._wake.set()
        if not self._idle:
            if self._pass(keys=[w.watch_key, w.bell_key, w.waiters_key], client=self.client,
                          args=[self.token]):
                w.holds = False
                w.until = 0.0
        self._unblock()

    def _block(self, client: redis.Redis, key: str, timeout_s: int) -> Any:
        if not self._rotate:
            try:
                return client.blmove(key, key, timeout_s, src="RIGHT", dest="RIGHT")
            except redis.ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                log.info("this Redis has no BLMOVE (before 6.2): watching with BRPOPLPUSH")
                self._rotate = True
        return client.brpoplpush(key, key, timeout_s)
