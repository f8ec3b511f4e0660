"""Leases: what a dead, frozen or cut-off worker held goes back to its queue within seconds.

kombu's Redis transport gives an unacknowledged message back only once it is older than the
visibility timeout (an hour by default), and a live worker cannot extend it: a worker killed with
``kill -9`` strands what it held for that hour, and a shorter timeout robs live workers whose
kernels run longer. Here every message the take script records is also leased to its holder, in
the same atomic step, until a time on Redis' clock (``ASYNCINFER_LEASE_S`` ahead):

- a live worker renews the leases of everything it holds every third of the lease, on a thread of
  its own, whatever its kernels take (and moves kombu's ``unacked_index`` time along with it, so
  the visibility timeout never robs it either);
- every worker sweeps about once a second for leases that expired — their holder stopped renewing
  — and puts those messages back at the front of the lists they came from, marked
  ``redelivered`` as kombu marks them, all in one script that checks the lease is still expired
  (a holder that renewed in between keeps it);
- a renewal that finds no holder for a message it holds, and no mark that the message went back
  to its queue, knows Redis forgot it (restarted without its data, or a failover to a replica
  behind): the holder leases it again from what it holds (and runs it), unless its answer is
  stored already — nobody else can have it;
- a worker starting on a host takes back at once what a dead process of that host held (a
  restarted worker gets its predecessor's requests without waiting for the lease);
- while a request's batch is on the device its lease says so (the device marks, written by the
  device thread as the batch launches without waiting for Redis: device_marks.py says exactly
  what is guaranteed); a worker that dies then counts one death against the request
  (``asyncinfer:deaths:<id>``). The take reads the count: a request
  that saw a death runs in a device batch of its own, and one that saw
  ``ASYNCINFER_MAX_WORKER_DEATHS`` fails for good with ``WorkerLost``.

A holder is ``node host pid start``: the worker's name, its host, its process ID and the process'
start time (so a reused PID, or a container restarted as PID 1, is not mistaken for the dead one).
The visibility timeout stays as the backstop for consumers that take no leases.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from asyncinfer.backoff import Backoff
from asyncinfer.broker.device_marks import DeviceMarks, OnDevice
from asyncinfer.broker.keyspace import keyspace
from asyncinfer.broker.scripts import script
from asyncinfer.broker.take import LeaseTerms
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.keys import (
    DEATHS_PREFIX,
    HUNG_PREFIX,
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    RECLAIMED_PREFIX,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)

__all__ = ["Leases", "holder_of", "holder_of_this_process", "is_dead_here", "redelivered_text"]

log = logging.getLogger(__name__)

_RENEW = script("lease_renew")
_EXPIRED = script("lease_expired")
_RECLAIM = script("lease_reclaim")
_ADOPT = script("lease_adopt")

_RECLAIM_KEYS = (LEASES_KEY, LEASE_HOLDERS_KEY, LEASE_DEVICE_KEY, UNACKED_INDEX_KEY, UNACKED_KEY)


def _start_ticks(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot, Linux), '' where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return ""


def holder_of(node: str, pid: int) -> str:
    """The holder name of process ``pid`` of this host, worker ``node``: ``node host pid start``
    (no tabs: the holder entry uses one)."""
    name = f"{node} {socket.gethostname()} {pid} {_start_ticks(pid) or '0'}"
    return name.replace("\t", " ")


def holder_of_this_process(node: str) -> str:
    """This process' holder name (:func:`holder_of`)."""
    return holder_of(node, os.getpid())


def is_dead_here(holder: str, host: str | None = None) -> bool:
    """Whether ``holder`` names a process of this host (``host``) that no longer runs: its PID
    is gone, or now belongs to a process started at another time."""
    parts = holder.rsplit(" ", 3)
    if len(parts) != 4 or parts[1] != (host or socket.gethostname()):
        return False
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    if pid == os.getpid():
        return parts[3] != (_start_ticks(pid) or "0")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    started = _start_ticks(pid)
    return bool(started) and started != parts[3]


def redelivered_text(unacked_entry: bytes | str) -> tuple[str, str] | None:
    """kombu's ``[envelope, exchange, routing_key]`` entry as the message that goes back on its
    queue (``redelivered``, as kombu's restore marks it), and its routing key; None if it does
    not read as one."""
    try:
        envelope, _exchange, routing_key = json.loads(unacked_entry)
        envelope.setdefault("headers", {})["redelivered"] = True
        envelope["properties"].setdefault("delivery_info", {})["redelivered"] = True
        return json.dumps(envelope), str(routing_key)
    except Exception:  # noqa: BLE001 - an entry kombu itself could not restore either
        return None


class Leases:
    """The leases of one worker process: renewal, the sweep, and the marks of what is on the
    device. ``held()`` gives the delivery tags the worker holds now."""

    #: Most expired leases one sweep reclaims.
    sweep_batch = 200

    def __init__(self, client: redis.Redis, marks: redis.Redis, *, node: str, lease_s: float,
                 deaths_ttl_s: float, count_deaths: bool, held: Callable[[], Iterable[str]],
                 sweep_every_s: float = 1.0,
                 on_lost: Callable[[list[str]], object] | None = None,
                 on_forgotten: Callable[[list[str]], object] | None = None) -> None:
        self.client = client  # the lease thread's own connection
        # ``marks``: the client whose address, credentials and TLS the device marks take (on a
        # connection of their own)
        self.holder = holder_of_this_process(node)
        self.lease_s = lease_s
        self.deaths_ttl_s = max(1, int(deaths_ttl_s))
        self.count_deaths = count_deaths
        self.renew_every_s = lease_s / 3
        #: 0: this one does not sweep (another of the process does: one sweeper per worker).
        self.sweep_every_s = self._sweep_s = min(sweep_every_s, lease_s / 3)
        self._held = held
        #: Told the tags of held messages found leased to another worker (what it need not run).
        self.on_lost = on_lost
        #: Told the tags of held messages that Redis forgot (no holder, never put back): the
        #: holder takes them again (:meth:`adopt`) or gives them up.
        self.on_forgotten = on_forgotten
        self._renew = client.register_script(_RENEW)
        self._expired = client.register_script(_EXPIRED)
        self._reclaim = client.register_script(_RECLAIM)
        self._adopt = client.register_script(_ADOPT)
        #: Key names in the scripts' ARGV, on a cluster's shard as on one Redis (keyspace.py).
        self._space = keyspace(client)
        self._stopped = threading.Event()
        self._thread = vital_thread(self._run, "asyncinfer-leases")
        #: One renewal at a time (the lease thread's, and the launch gate's: lease_gate.py).
        self._renewing = threading.Lock()
        #: When (``time.perf_counter``) the last renewal that Redis answered was sent: every
        #: lease this worker held then runs ``lease_s`` from about that moment.
        self.renewed_at = time.perf_counter()
        #: What is on the device now, on Redis (device_marks.py).
        self.device_marks = DeviceMarks(marks)
        #: Counts for the note and the tests: put back by this worker's sweeps, deaths counted,
        #: held requests found leased to another (this worker was too late renewing), held
        #: requests Redis forgot and this worker leased again.
        self.reclaimed = 0
        self.deaths_counted = 0
        self.lost = 0
        self.adopted = 0

    def note_hang(self, request_ids: Iterable[str], line: str) -> None:
        """Keep ``line`` (a hang of the device) against each of ``request_ids`` for as long as
        their death counts live."""
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.set(HUNG_PREFIX + request_id, line, ex=self.deaths_ttl_s)
        pipe.execute()

    def hang_note(self, request_id: str) -> str:
        """The last hang noted against ``request_id`` ('' when none, or Redis cannot say)."""
        try:
            line = self.client.get(HUNG_PREFIX + request_id)
        except redis.RedisError:
            return ""
        return line.decode(errors="replace") if isinstance(line, bytes) else str(line or "")

    def sweeps(self, on: bool) -> None:
        """Whether this one sweeps (its interval as made) or leaves it to another of the process."""
        self.sweep_every_s = self._sweep_s if on else 0.0

    @property
    def terms(self) -> LeaseTerms:
        """What the take script needs to lease what it records."""
        return LeaseTerms(self.lease_s, self.holder, DEATHS_PREFIX if self.count_deaths else "")

    def start(self) -> Leases:
        """Take back what dead processes of this host held, then renew and sweep on a thread."""
        try:
            self.take_back_dead()
        except redis.RedisError as exc:  # the sweep finds them once their leases expire
            log.warning("could not look for requests of dead workers on this host (%s)", exc)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self.device_marks.close()

    # -- the device marks -----------------------------------------------------------------------

    def on_device(self, marks: Sequence[tuple[str, str, OnDevice]], wait: bool = False) -> None:
        """``marks`` — (delivery tag, request ID, work item) — are going onto the device: a death
        from now on counts against them. The marks of batches that came off the device since the
        last call are removed in the same send. On the device thread, before the batch starts;
        it does not wait for Redis unless ``wait`` (device_marks.py says what is guaranteed)."""
        if self.count_deaths:
            self.device_marks.on_device(marks, wait)

    # -- renewal and sweep ---------------------------------------------------------------------

    def renew(self) -> list[str]:
        """Renew the lease of everything held; the tags found leased to another holder (or gone
        back to their queue). Those that Redis forgot go to ``on_forgotten``."""
        with self._renewing:
            sent_at = time.perf_counter()
            tags = [t for t in self._held() if t]
            if not tags:
                self.renewed_at = sent_at
                return []
            lost, forgotten = ([_text(t) for t in found] for found in self._renew(
                keys=[LEASES_KEY, LEASE_HOLDERS_KEY, UNACKED_INDEX_KEY],
                args=[self.lease_s, self.holder, time.time(), self._space.key(RECLAIMED_PREFIX),
                      *tags]))
            self.renewed_at = sent_at
        if lost or forgotten:  # those answered since the snapshot are no longer held
            still = set(self._held())
            lost = [t for t in lost if t in still]
            forgotten = [t for t in forgotten if t in still]
        if lost:
            self.lost += len(lost)
            log.warning("%d held requests are leased to another worker now (this one renewed too "
                        "late: frozen, or cut off from Redis); they may run twice", len(lost))
            if self.on_lost is not None:
                self.on_lost(lost)
        if forgotten:
            log.warning("Redis forgot %d requests this worker holds (restarted without its data, "
                        "or a failover to a replica behind); leasing them again", len(forgotten))
            if self.on_forgotten is not None:
                self.on_forgotten(forgotten)
        return lost

    def adopt(self, messages: Sequence[tuple[str, str, str]]) -> list[str]:
        """Lease again ``messages`` — (tag, the list it came from, kombu's unacked entry) — that
        Redis forgot; the tags leased (not those another holder took, or that went back to their
        queue, meanwhile)."""
        if not messages:
            return []
        space = self._space
        args: list[Any] = [self.lease_s, self.holder, space.key(RECLAIMED_PREFIX)]
        for tag, list_name, entry in messages:
            args += (tag, space.key(space.name(list_name)), entry)
        adopted = [_text(t) for t in self._adopt(
            keys=[LEASES_KEY, LEASE_HOLDERS_KEY, UNACKED_KEY], args=args)]
        self.adopted += len(adopted)
        return adopted

    def sweep(self) -> int:
        """Put back what expired leases held; how many messages went back."""
        flat = self._expired(keys=[LEASES_KEY, LEASE_HOLDERS_KEY, UNACKED_KEY],
                             args=[self.sweep_batch])
        found = [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]
        return self._put_back(found, expired_only=True)

    def take_back_dead(self) -> int:
        """Put back at once what dead processes of this host held; how many went back."""
        host = socket.gethostname()
        found = []
        for tag, entry in self.client.hscan_iter(LEASE_HOLDERS_KEY, count=500):
            holder = _text(entry).split("\t", 1)[0]
            if holder != self.holder and is_dead_here(holder, host):
                found.append((tag, entry, self.client.hget(UNACKED_KEY, tag) or b""))
        back = self._put_back(found, expired_only=False)
        if found:
            log.warning("took back %d requests that a dead worker of this host held", back)
        return back

    def _put_back(self, found: list[tuple[Any, Any, Any]], expired_only: bool) -> int:
        if not found:
            return 0
        # Deaths are counted for whatever another holder marked as on its device, whether or not
        # this holder marks its own (every sweeper of the fleet must count them, or a request
        # that kills its workers would be isolated only when the right worker swept)
        space = self._space
        args: list[Any] = ["1" if expired_only else "0", space.key(DEATHS_PREFIX),
                           self.deaths_ttl_s, space.key(RECLAIMED_PREFIX)]
        for tag, entry, unacked in found:
            came_from = _text(entry).split("\t", 1)
            restored = redelivered_text(unacked) if unacked else None
            if restored is None:
                list_key, text = "", ""
                if unacked:
                    log.error("lease %s: its message does not read as kombu's; dropped: %r",
                              _text(tag), unacked[:200])
            else:
                text, routing_key = restored
                list_key = came_from[1] if len(came_from) == 2 and came_from[1] else routing_key
                list_key = space.key(space.name(list_key))  # either form: as Redis holds it
            args += [tag, entry, list_key, text]
        back, deaths = self._reclaim(keys=list(_RECLAIM_KEYS), args=args)
        self.reclaimed += int(back)
        self.deaths_counted += int(deaths)
        if back:
            log.warning("put back %d requests whose worker stopped renewing its leases%s",
                        back, f" ({deaths} were on its device)" if deaths else "")
        return int(back)

    def _run(self) -> None:
        next_renewal = time.monotonic() + self.renew_every_s
        backoff = Backoff()
        while not self._stopped.wait(self.sweep_every_s or self.renew_every_s):
            try:
                if time.monotonic() >= next_renewal:
                    next_renewal = time.monotonic() + self.renew_every_s
                    self.renew()
                while self.sweep_every_s and self.sweep() >= self.sweep_batch:
                    pass
                backoff.reset()
            except redis.RedisError as exc:
                wait_s = backoff.failed()
                log.warning("leases: Redis failed (%s: %s); again in %.1f s", type(exc).__name__,
                            exc, wait_s)
                self._stopped.wait(wait_s)
            except Exception:  # noqa: BLE001 - the renewal must outlive whatever goes wrong
                log.exception("leases: unexpected error")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
