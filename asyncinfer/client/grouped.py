"""Publishing without a round trip per request: what arrived while the last round trip was out
goes in the next one.

A producer a zone away from Redis (a round trip of milliseconds) that waited for each push could
send at most one request per round trip, whatever it kept in flight. A grouped publisher takes
every request handed to it since its last send and sends them together, in one pipeline on one
connection: one call of the publish script per queue, holding that queue's requests in the order
they were handed over (or, with nothing to check, one LPUSH per list). A single request costs what
it did (one round trip); a thousand cost about one too.

The rules live here once, without I/O (:class:`Pending`: what waits for a group; :class:`Group`:
one group's commands and what each reply means); two forms drive them: :class:`GroupedPublisher`,
a thread per client (the blocking ``Client``), and the event loop's (loop_publisher.py: the
asyncio forms and the gateway).

Each request keeps the rules of a publish of its own (publisher.py): the claim of a
caller-chosen ID, the queue bound, the trace, the replica wait. The script runs each request's
rules in turn, atomically, so a queue found full stays full for the rest of the call: where a
request must wait for room, the requests behind it on that queue (none of them pushed) wait with
it (a pause that doubles, as one publish's does) and go out in order once there is room. A
duplicate in one group finds the claim its first wrote. One WAIT after the group covers every
request in it.

What each request came to is handed to its ``done`` callback, in the order of the group: the
status (PUBLISHED or DUPLICATE), or the error — QueueFull, InvalidRequest (an ID sent to another
queue), or the broker's error (Redis unreachable, refusing writes, replicas not confirming); an
error reply to a script call ends every request of that call with it. A group's pipeline is never
sent twice: its connection does not retry (connections.never_resend), since a connection lost
after Redis ran the group would push every request again; each request of a group Redis went away
under hears the broker's error instead (it may have reached its queue). A request is never
dropped: :meth:`GroupedPublisher.close` sends what is still pending (each one waiting for room at
most its own timeout), and so does the interpreter's exit.
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

from asyncinfer.broker.connections import not_replicated, wait_replicas
from asyncinfer.broker.direct_pipeline import direct_pipeline
from asyncinfer.broker.publisher import (
    _PUBLISH,
    PUBLISHED,
    TRACE_PUSH,
    Publisher,
    _Push,
    script_arguments,
    trace_push_arguments,
)

__all__ = ["GroupedPublisher", "Pending", "Group", "Entry", "Done", "DescribeError"]

log = logging.getLogger(__name__)

#: What a request came to: its status (PUBLISHED, DUPLICATE) and None, or None and its error.
Done = Callable[[int | None, BaseException | None], None]
#: The error for a request a Redis error met: (request ID, the error) → the error to report.
DescribeError = Callable[[str, redis.RedisError], BaseException]


@dataclass
class Entry:
    """A request waiting for its group, and who hears what it came to. ``withdrawn``: whether
    its sender stopped waiting for it (a cancelled coroutine): one not sent yet never is."""

    push: _Push
    done: Done
    withdrawn: Callable[[], bool] | None = None


#: A queue and its bound: the requests one script call takes.
_Key = tuple[str, int, str]


class Pending:
    """The requests waiting for a group, per queue in the order handed over. No locks, no I/O:
    the thread form calls it under its lock, the loop form from its loop."""

    #: At most this many requests, or about this many bytes of messages, in one group.
    max_requests = 1024
    max_bytes = 8 * 1024 * 1024

    def __init__(self) -> None:
        self._queues: dict[_Key, deque[Entry]] = {}
        #: A queue whose first request waits for room: when to look again.
        self._paused_until: dict[_Key, float] = {}

    def __bool__(self) -> bool:
        return bool(self._queues)

    def add(self, entry: Entry) -> None:
        self._queues.setdefault(entry.push.group_key, deque()).append(entry)

    def take(self, now: float) -> tuple[list[list[Entry]], float | None]:
        """The next group (per queue, its requests in order; none of a paused queue's: empty
        when every queue is paused or none waits) and when the first paused queue is due."""
        count, size = 0, 0
        group: list[list[Entry]] = []
        wake_at: float | None = None
        for key, entries in self._queues.items():
            until = self._paused_until.get(key, 0.0)
            if until > now:
                wake_at = until if wake_at is None else min(wake_at, until)
                continue
            taken: list[Entry] = []
            while entries and count < self.max_requests and size < self.max_bytes:
                entry = entries.popleft()
                if entry.withdrawn is not None and entry.withdrawn():
                    continue
                taken.append(entry)
                count, size = count + 1, size + len(entry.push.message)
            if taken:
                group.append(taken)
        for key in [k for k, entries in self._queues.items() if not entries]:
            del self._queues[key]
            self._paused_until.pop(key, None)
        return group, wake_at

    def put_back(self, entries: list[Entry], pause_s: float) -> None:
        """``entries`` (one queue's, in order) first again on their queue, looked at again in
        ``pause_s``."""
        key = entries[0].push.group_key
        self._queues.setdefault(key, deque()).extendleft(reversed(entries))
        if pause_s > 0:
            self._paused_until[key] = time.monotonic() + pause_s
        else:
            self._paused_until.pop(key, None)


class Group:
    """One group on its way: its commands (:meth:`fill`), then what the replies mean for each
    request (:meth:`read`, :meth:`confirm`, :meth:`failed`). ``publisher``: the script, the TTLs
    and the replica wait the requests were prepared with; ``script_lost``: Redis answered the
    last group that it lacks the publish script, so this one sends the script's text (EVAL, which
    also loads it) instead of its SHA."""

    def __init__(self, taken: list[list[Entry]], publisher: Any, describe_error: DescribeError,
                 *, script_lost: bool = False) -> None:
        self.taken, self.publisher, self.describe_error = taken, publisher, describe_error
        self._by_text = script_lost
        #: (scripted: its replies a status per request, its requests) per command
        self._calls: list[tuple[bool, list[Entry]]] = []
        #: Sent requests and their status, told once :meth:`confirm` knows the replicas'.
        self.sent: list[tuple[Entry, int]] = []
        #: Requests to send again (one queue's each, in order) and after how long.
        self.again: list[tuple[list[Entry], float]] = []
        #: Redis lost its scripts (a restart, SCRIPT FLUSH): the next group sends the text.
        self.script_lost = False

    def fill(self, pipe: Any) -> Any:
        """Queue the group's commands on ``pipe`` (a redis-py pipeline, blocking or asyncio)."""
        for entries in self.taken:
            list_key = entries[0].push.list_key
            if all(e.push.trace_only and e.push.list_key == list_key for e in entries):
                keys, args = trace_push_arguments([e.push for e in entries])
                if self._by_text:
                    pipe.eval(TRACE_PUSH, len(keys), *keys, *args)
                else:
                    pipe.evalsha(self.publisher._trace_push.sha, len(keys), *keys, *args)
                self._calls.append((False, entries))
                continue
            if any(e.push.scripted for e in entries):
                keys, args = script_arguments([e.push for e in entries])
                if self._by_text:
                    pipe.eval(_PUBLISH, len(keys), *keys, *args)
                else:
                    pipe.evalsha(self.publisher._publish.sha, len(keys), *keys, *args)
                self._calls.append((True, entries))
                continue
            lists: dict[str, list[Entry]] = {}  # nothing to check: one LPUSH per list, in order
            for entry in entries:
                lists.setdefault(entry.push.list_key, []).append(entry)
            for list_key, on_list in lists.items():
                pipe.lpush(list_key, *(e.push.message for e in on_list))
                self._calls.append((False, on_list))
        return pipe

    def failed(self, exc: BaseException) -> None:
        """The pipeline did not come back: every request of the group hears ``exc``."""
        for entries in self.taken:
            for entry in entries:
                _tell(entry, None, self._error(entry, exc))

    def read(self, replies: list[Any]) -> None:
        """The pipeline's replies: the refused told, those to send again in :attr:`again`, the
        sent in :attr:`sent`."""
        for (scripted, entries), reply in zip(self._calls, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):  # nothing ran: send it again
                self.script_lost = True
                self.again.append((entries, 0.0))
            elif isinstance(reply, Exception):  # the whole call was refused
                for entry in entries:
                    _tell(entry, None, self._error(entry, reply))
            elif scripted:
                self._read_script(entries, reply)
            else:
                self.sent += [(entry, PUBLISHED) for entry in entries]

    def _read_script(self, entries: list[Entry], reply: list[Any]) -> None:
        """One script call's reply, request by request: a request waiting for room goes back with
        those behind it (the queue full, none of them was pushed)."""
        for i, entry in enumerate(entries):
            try:
                status = entry.push.status(reply[2 * i:2 * i + 2])
            except Exception as exc:  # noqa: BLE001 - QueueFull, InvalidRequest: this request's
                _tell(entry, None, exc)
                continue
            if status is None:  # the queue is full and it waits for room
                self.again.append((entries[i:], entry.push.pause_s()))
                return
            self.sent.append((entry, status))

    @property
    def waits_for_replicas(self) -> bool:
        """Whether :meth:`confirm` needs the replicas' count (a WAIT) first."""
        return bool(self.sent) and bool(self.publisher.replicas)

    def confirm(self, confirmed: int | None = None, error: BaseException | None = None) -> None:
        """Tell each sent request, given the count of replicas that hold the group (when
        :attr:`waits_for_replicas`) or the error that asking for it met."""
        publisher = self.publisher
        for entry, status in self.sent:
            if error is not None:
                _tell(entry, None, self._error(entry, error))
            elif self.waits_for_replicas:
                assert confirmed is not None
                _tell(entry, status, not_replicated(
                    f"request {entry.push.request_id}", confirmed, publisher.replicas,
                    publisher.replicas_timeout_ms))
            else:
                _tell(entry, status, None)

    def _error(self, entry: Entry, exc: BaseException) -> BaseException:
        if isinstance(exc, redis.RedisError):
            described = self.describe_error(entry.push.request_id, exc)
            described.__cause__ = exc
            return described
        return exc


class GroupedPublisher:
    """Sends requests handed over with :meth:`put` through ``publisher``'s Redis client, a group
    per round trip, on a thread of its own (started by the first :meth:`put` of a process)."""

    def __init__(self, publisher: Publisher, describe_error: DescribeError) -> None:
        self.publisher = publisher
        self.describe_error = describe_error
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending = Pending()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._script_lost = True  # the first group loads the script (EVAL)

    def put(self, push: _Push, done: Done, withdrawn: Callable[[], bool] | None = None) -> None:
        """Send ``push`` in the next group; ``done`` hears what it came to (on the group's
        thread); once ``withdrawn()`` is true (its future was cancelled) it is not sent if it
        has not been yet."""
        with self._lock:
            if self._closing:
                raise RuntimeError(f"request {push.request_id}: the client is closed")
            if self._pid != os.getpid():  # the first put, or the first in a forked child
                self._start()
            self._pending.add(Entry(push, done, withdrawn))
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
        self._pending, self._pid = Pending(), os.getpid()
        self._thread = threading.Thread(target=self._run, daemon=True, name="asyncinfer-publish")
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    def _run(self) -> None:
        while (taken := self._take()) is not None:
            group = Group(taken, self.publisher, self.describe_error,
                          script_lost=self._script_lost)
            try:
                self._send(group)
            except BaseException as exc:  # noqa: BLE001 - every request of the group hears it
                log.exception("publishing a group of requests failed")
                group.failed(exc)

    def _take(self) -> list[list[Entry]] | None:
        """The next group; None once closing and nothing is left."""
        with self._lock:
            while True:
                now = time.monotonic()
                taken, wake_at = self._pending.take(now)
                if taken:
                    return taken
                if self._closing and not self._pending:
                    return None
                self._changed.wait(None if wake_at is None else max(0.0, wake_at - now))

    def _send(self, group: Group) -> None:
        client = self.publisher.client
        try:
            replies = group.fill(direct_pipeline(client)).execute(raise_on_error=False)
        except redis.RedisError as exc:
            group.failed(exc)
            return
        group.read(replies)
        self._script_lost = group.script_lost
        if group.again:
            with self._lock:
                for entries, pause_s in group.again:
                    self._pending.put_back(entries, pause_s)
        if not group.waits_for_replicas:
            group.confirm()
            return
        publisher = self.publisher
        try:
            confirmed = wait_replicas(client, publisher.replicas, publisher.replicas_timeout_ms)
        except redis.RedisError as exc:
            group.confirm(error=exc)
            return
        group.confirm(confirmed)


def _tell(entry: Entry, status: int | None, error: BaseException | None) -> None:
    try:
        entry.done(None if error is not None else status, error)
    except Exception:  # noqa: BLE001 - one caller's callback must not stop the others'
        log.exception("request %s: its publish callback failed", entry.push.request_id)


def _close_at_exit(ref: weakref.ref[GroupedPublisher]) -> None:
    grouped = ref()
    if grouped is not None:
        grouped.close()
