"""Publishing without a round trip per request: what arrived while the last round trip was out
goes in the next one.

A producer a zone away from Redis (a round trip of milliseconds) that waited for each push could
send at most one request per round trip, whatever it kept in flight. :class:`GroupedPublisher` is
one thread per client that takes every request handed to it since its last send and sends them
together, in one pipeline: one call of the publish script per queue, holding that queue's
requests in the order they were handed over (or, with nothing to check, one LPUSH per list). A
single request costs what it did (one round trip); a thousand cost about one too.

Each request keeps the rules of a publish of its own (publisher.py): the claim of a
caller-chosen ID, the queue bound, the trace, the replica wait. The script runs each request's
rules in turn, atomically, so a queue found full stays full for the rest of the call: where a
request must wait for room, the requests behind it on that queue (none of them pushed) wait with
it (a pause that doubles, as one publish's does) and go out in order once there is room. A
duplicate in one group finds the claim its first wrote. One WAIT after the group covers every
request in it.

What each request came to is handed to its ``done`` callback, in the order of the group: the
status (PUBLISHED or DUPLICATE), or the error — QueueFull, InvalidRequest (an ID sent to another
queue), or the broker's error (Redis unreachable, refusing writes, replicas not confirming). A
request is never dropped: :meth:`GroupedPublisher.close` sends what is still pending (each one
waiting for room at most its own timeout), and so does the interpreter's exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from asyncinfer.client.publisher import _PUBLISH, PUBLISHED, Publisher, _Push, script_arguments
from asyncinfer.connections import not_replicated, wait_replicas

__all__ = ["GroupedPublisher", "Done"]

log = logging.getLogger(__name__)

#: What a request came to: its status (PUBLISHED, DUPLICATE) and None, or None and its error.
Done = Callable[[int | None, BaseException | None], None]
#: The error for a request a Redis error met: (request ID, the error) → the error to report.
DescribeError = Callable[[str, redis.RedisError], BaseException]


@dataclass
class _Entry:
    push: _Push
    done: Done


#: A queue and its bound: the requests one script call takes.
_Key = tuple[str, int]


class GroupedPublisher:
    """Sends requests handed over with :meth:`put` through ``publisher``'s Redis client, a group
    per round trip, on a thread of its own (started by the first :meth:`put` of a process)."""

    #: At most this many requests, or about this many bytes of messages, in one group.
    max_requests = 1024
    max_bytes = 8 * 1024 * 1024

    def __init__(self, publisher: Publisher, describe_error: DescribeError) -> None:
        self.publisher = publisher
        self.describe_error = describe_error
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: dict[_Key, deque[_Entry]] = {}
        #: A queue whose first request waits for room: when to look again.
        self._paused_until: dict[_Key, float] = {}
        self._closing = False
        self._thread: threading.Thread | None = None
        self._pid = 0

    def put(self, push: _Push, done: Done) -> None:
        """Send ``push`` in the next group; ``done`` hears what it came to (on the group's
        thread)."""
        with self._lock:
            if self._closing:
                raise RuntimeError(f"request {push.request_id}: the client is closed")
            if self._pid != os.getpid():  # the first put, or the first in a forked child
                self._start()
            self._pending.setdefault((push.queue, push.max_queue_size), deque()).append(
                _Entry(push, done))
            self._changed.notify()

    def close(self) -> None:
        """Send every pending request, then stop the thread."""
        with self._lock:
            self._closing = True
            self._changed.notify()
            thread = self._thread if self._pid == os.getpid() else None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start(self) -> None:
        self._pending, self._paused_until, self._pid = {}, {}, os.getpid()
        self._thread = threading.Thread(target=self._run, daemon=True, name="asyncinfer-publish")
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    def _run(self) -> None:
        while (group := self._take()) is not None:
            try:
                self._send(group)
            except BaseException as exc:  # noqa: BLE001 - every request of the group hears it
                log.exception("publishing a group of requests failed")
                for entries in group:
                    for entry in entries:
                        _tell(entry, None, exc)

    def _take(self) -> list[list[_Entry]] | None:
        """The next group: per queue, its requests in order (none of a paused queue's); None
        once closing and nothing is left."""
        with self._lock:
            while True:
                now, count, size = time.monotonic(), 0, 0
                group: list[list[_Entry]] = []
                wake_at: float | None = None
                for key, entries in self._pending.items():
                    until = self._paused_until.get(key, 0.0)
                    if until > now:
                        wake_at = until if wake_at is None else min(wake_at, until)
                        continue
                    taken: list[_Entry] = []
                    while entries and count < self.max_requests and size < self.max_bytes:
                        entry = entries.popleft()
                        taken.append(entry)
                        count, size = count + 1, size + len(entry.push.message)
                    if taken:
                        group.append(taken)
                for key in [k for k, entries in self._pending.items() if not entries]:
                    del self._pending[key]
                    self._paused_until.pop(key, None)
                if group:
                    return group
                if self._closing and not self._pending:
                    return None
                self._changed.wait(None if wake_at is None else max(0.0, wake_at - now))

    def _send(self, group: list[list[_Entry]]) -> None:
        publisher = self.publisher
        pipe = publisher.client.pipeline(transaction=False)
        calls: list[tuple[bool, list[_Entry]]] = []  # (scripted, its requests) per command
        for entries in group:
            if any(e.push.scripted for e in entries):
                keys, args = script_arguments([e.push for e in entries])
                pipe.evalsha(publisher._publish.sha, len(keys), *keys, *args)
                calls.append((True, entries))
                continue
            lists: dict[str, list[_Entry]] = {}  # nothing to check: one LPUSH per list, in order
            for entry in entries:
                lists.setdefault(entry.push.list_key, []).append(entry)
            for list_key, on_list in lists.items():
                pipe.lpush(list_key, *(e.push.message for e in on_list))
                calls.append((False, on_list))
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            for entries in group:
                for entry in entries:
                    _tell(entry, None, self.describe_error(entry.push.request_id, exc))
            return
        sent: list[tuple[_Entry, int]] = []
        for (scripted, entries), reply in zip(calls, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):  # Redis lost its scripts
                publisher.client.script_load(_PUBLISH)
                self._put_back(entries, pause_s=0.0)
            elif isinstance(reply, Exception):
                for entry in entries:
                    _tell(entry, None, self._error(entry, reply))
            elif scripted:
                sent += self._read(entries, reply)
            else:
                sent += [(entry, PUBLISHED) for entry in entries]
        self._confirm(sent)

    def _read(self, entries: list[_Entry], reply: list[Any]) -> list[tuple[_Entry, int]]:
        """The script's reply, request by request: those sent; the refused told; a request
        waiting for room put back, with those behind it (the queue full, none of them was
        pushed)."""
        sent = []
        for i, entry in enumerate(entries):
            try:
                status = entry.push.status(reply[2 * i:2 * i + 2])
            except Exception as exc:  # noqa: BLE001 - QueueFull, InvalidRequest: this request's
                _tell(entry, None, exc)
                continue
            if status is None:  # the queue is full and it waits for room
                self._put_back(entries[i:], pause_s=entry.push.pause_s())
                break
            sent.append((entry, status))
        return sent

    def _confirm(self, sent: list[tuple[_Entry, int]]) -> None:
        """Tell each sent request, once the replicas hold the group (when asked for)."""
        publisher = self.publisher
        if sent and publisher.replicas:
            try:
                confirmed = wait_replicas(publisher.client, publisher.replicas,
                                          publisher.replicas_timeout_ms)
            except redis.RedisError as exc:
                for entry, _ in sent:
                    _tell(entry, None, self._error(entry, exc))
                return
            for entry, status in sent:
                _tell(entry, status, not_replicated(
                    f"request {entry.push.request_id}", confirmed, publisher.replicas,
                    publisher.replicas_timeout_ms))
            return
        for entry, status in sent:
            _tell(entry, status, None)

    def _error(self, entry: _Entry, exc: Exception) -> BaseException:
        if isinstance(exc, redis.RedisError):
            return self.describe_error(entry.push.request_id, exc)
        return exc

    def _put_back(self, entries: list[_Entry], *, pause_s: float) -> None:
        """``entries`` (one queue's, in order) first again on their queue, looked at again in
        ``pause_s``."""
        key = (entries[0].push.queue, entries[0].push.max_queue_size)
        with self._lock:
            self._pending.setdefault(key, deque()).extendleft(reversed(entries))
            if pause_s > 0:
                self._paused_until[key] = time.monotonic() + pause_s
            else:
                self._paused_until.pop(key, None)


def _tell(entry: _Entry, status: int | None, error: BaseException | None) -> None:
    try:
        entry.done(None if error is not None else status, error)
    except Exception:  # noqa: BLE001 - one caller's callback must not stop the others'
        log.exception("request %s: its publish callback failed", entry.push.request_id)


def _close_at_exit(ref: weakref.ref[GroupedPublisher]) -> None:
    grouped = ref()
    if grouped is not None:
        grouped.close()
