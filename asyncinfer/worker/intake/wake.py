"""Waking an idle consumer when a request arrives, without taking the request.

A blocking pop (BRPOP, kombu's way) hands a message to the worker before the worker has recorded
it as unacknowledged: a worker killed in between loses it. Redis has no command that blocks until
one of several lists is non-empty without popping, but ``BLMOVE list list RIGHT RIGHT`` on a single
list does exactly that: it blocks while the list is empty and then moves the tail element onto the
tail of the same list — a no-op, done atomically. So every list an idle consumer watches gets one
thread with its own connection that blocks in that command; when one returns, the consumer wakes
and takes with the atomic take script (take.py). Nothing ever leaves a queue except through that
script, whoever the producer is (our client, Celery's ``send_task``, ``redis-cli``, another
language), so a request is at all times either on its queue or in kombu's unacknowledged
bookkeeping.

The caller itself waits on the first list (its main queue, where nearly all requests arrive)
on a connection of its own, so the common wake-up costs no thread hand-off (each hand-off waits
for the GIL, which a busy device thread holds). A push must not wake every idle worker of a fleet
(BLMOVE of a list onto itself leaves it non-empty, so Redis serves every client blocked on it: N
takes for one request, N − 1 of them empty). So one idle consumer per list *watches* it — it
holds ``asyncinfer:watch:<list>`` (a token with a short TTL, renewed while it waits) and blocks
with BLMOVE — and the others wait on ``asyncinfer:bell:<list>`` (BLPOP), counted in
``…:waiters``. When others wait, the watcher's take passes the watch on: it gives the token up
and rings the bell, waking exactly one other idle consumer, which takes what came meanwhile and
watches next; alone, it keeps the watch. A take that fills its room and leaves messages rings the
bell too (take.py). A watcher that dies or freezes holds the token until its TTL passes;
meanwhile the others still take at least once per wait (about a second).

Watcher threads cover the other lists (priority lists, other queues); one that fires sets the
wake-up flag and, if the caller is blocked in Redis, cuts that block short with ``CLIENT UNBLOCK``. A
watcher that fired waits until the consumer is idle again (:meth:`Waker.arm`) before it blocks
again; otherwise it would spin on a list that is not empty. Redis older than 6.2 has no BLMOVE:
``BRPOPLPUSH list list`` is used instead (it moves the oldest message to the front of its list,
which changes the order of that one message, never loses it).
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
from asyncinfer.engine.vital import vital_thread
from asyncinfer.keys import BELL_PREFIX, WAITERS_SUFFIX, WATCH_PREFIX

__all__ = ["Waker"]

log = logging.getLogger(__name__)

# KEYS: a list's watch. ARGV: the consumer's token, the watch's lifetime (ms). 1 when this
# consumer watches the list now (it took the watch, or renewed its own), else 0.
_CLAIM = r"""
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: a bell's count of waiters. ARGV: +1 or -1. Never below 0; lapses 30 s after its last
# change (a waiter killed while it waited counts no longer).
_WAITING = r"""
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n < 0 then redis.call('SET', KEYS[1], 0) end
redis.call('EXPIRE', KEYS[1], 30)
return n
"""


class Waker:
    """Watches ``lists``; :meth:`wait` returns once one of them may hold a message.

    ``own`` is a single-connection client (``single_connection_client=True``) on which
    :meth:`wait` blocks on ``lists[0]``; ``client`` gives the watcher threads of the other lists a
    connection each. Neither may have a socket timeout shorter than ``block_s``.
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
        self._rotate = False  # BRPOPLPUSH instead of BLMOVE (Redis < 6.2)
        self._blocking = False  # the caller is in (or about to send) its blocking command
        self._own_id: int | None = None
        self._threads = [vital_thread(self._watch, f"asyncinfer-wake-{i}", key)
                         for i, key in enumerate(self.lists[1:], start=1)]
        #: This consumer's watch token (the take script passes the watch on with it).
        self.token = os.urandom(8).hex()
        self._claim = client.register_script(_CLAIM)
        self._waiting = client.register_script(_WAITING)
        self._watch_key = WATCH_PREFIX + self.lists[0]
        self._bell_key = BELL_PREFIX + self.lists[0]
        self._waiters_key = self._bell_key + WAITERS_SUFFIX
        #: Until when (monotonic) this consumer surely still holds the watch it claimed: no
        #: round trip to claim it again before then (its take says when it gave it up).
        self._watching_until = 0.0

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
        self._wake.clear()

    def arm(self) -> None:
        """The consumer is idle: every watcher that fired blocks on its list again."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

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
                else:  # another idle consumer watches: wait for its bell
                    found = self._wait_for_bell(block_s)
            except Exception:
                if self._done():
                    return True  # close() cut the connection
                raise
            return found is not None or self._wake.is_set()
        finally:
            self._blocking = False

    def watch_passed(self) -> None:
        """This consumer's take gave the watch of its first list up."""
        self._watching_until = 0.0

    def _watching(self, block_s: int) -> bool:
        """Whether this consumer watches its first list for the next ``block_s`` seconds: it
        held the watch recently enough, or it claims (or renews) it now."""
        now = time.monotonic()
        if now < self._watching_until:
            return True
        lifetime_s = block_s + self.watch_margin_s
        if self._claim(keys=[self._watch_key], client=self.own, args=[self.token, lifetime_s * 1000]):
            # sure for a little less than the watch lives, less the block that follows
            self._watching_until = now + self.watch_margin_s - 0.5
            return True
        self._watching_until = 0.0
        return False

    def _wait_for_bell(self, block_s: int) -> Any:
        """Wait for the watcher's bell, counted among its waiters (so that it passes the watch)."""
        self._waiting(keys=[self._waiters_key], client=self.own, args=[1])
        try:
            return self.own.blpop([self._bell_key], block_s)
        finally:
            try:
                self._waiting(keys=[self._waiters_key], client=self.own, args=[-1])
            except redis.RedisError:  # the count lapses by itself
                pass

    def close(self) -> None:
        """Stop the watchers (their blocked commands are cut by closing the connections)."""
        self._closed.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
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

    def _watch(self, key: str) -> None:
        seen = -1
        backoff = Backoff()
        while not self._done():
            with self._cond:
                while self._generation == seen and not self._done():
                    self._cond.wait()
                seen = self._generation
            while not self._done():
                try:
                    found = self._block(self.client, key, self.block_s)
                    backoff.reset()
                    if found is not None:
                        self._wake.set()
                        self._unblock()
                        break
                except Exception as exc:  # noqa: BLE001 - Redis errors, or a socket closed under it
                    if self._done():
                        return  # close() cut the connection
                    if self._wake.is_set():
                        break  # it fired; only cutting the caller's block short failed
                    wait_s = backoff.failed()
                    log.warning("watching %s failed (%s: %s); again in %.1f s", key,
                                type(exc).__name__, exc, wait_s)
                    self._closed.wait(wait_s)

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
