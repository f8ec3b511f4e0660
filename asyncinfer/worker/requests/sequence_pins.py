"""A worker's part in sequence batching across the fleet: its registration, and the sweep that
fails what a dead worker's sequences were sent.

A sequence's requests must all run where its state is. The publish script (broker/publisher.py)
pins a sequence, at its first request, to one live worker serving the model's sequences and pushes
each of its requests onto that worker's own list (constants.sequence_list), which only that worker
takes from. So each worker hosting a stateful model:

- **registers** in ``asyncinfer:sequence:workers:<model>`` (member ``list\\tholder\\ttimeout_s``:
  its own list, its lease holder — broker/leases.py — and the model's sequence timeout;
  score: until when it lives, on Redis' clock), renewed every third of ``ASYNCINFER_LEASE_S``
  (at start before it serves, then on its own thread). A worker that stops lapses its
  registration at once (score 0); one that dies, within the lease. From then on the publish
  script refuses the sequences pinned to it with SequenceStateLost, naming it. A worker whose
  renewal finds its registration lapsed (it was frozen or cut off past the lease: what it held
  was failed meanwhile by another worker's sweep) registers again only once its sequence books
  hold nothing in flight and a renewal period passed: what it ran of the failed requests is left
  out by the store and their state taken back (engine/sequences.py) before any new request of
  its sequences can reach it;
- **sweeps**, about once a second, the registrations that lapsed (other workers', of any model):
  what their own lists still hold — requests pushed before the death was seen, and those the
  lease sweep put back there — is taken (recorded and leased to this worker, as any take) and
  failed with SequenceStateLost, never run: no other worker has their sequences' state. A lapsed
  registration whose list stayed empty for ``grace_s`` is removed;
- **expires** the sequences its models held idle past their timeout (engine/sequences.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from asyncinfer.backoff import Backoff
from asyncinfer.broker.keyspace import keyspace
from asyncinfer.broker.publisher import worker_of_pin
from asyncinfer.broker.scripts import script
from asyncinfer.broker.take import LeaseTerms, Popped, Taker
from asyncinfer.constants import model_from_queue, queue_for, sequence_list
from asyncinfer.errors import SequenceStateLost
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.keys import SEQUENCE_MODELS_KEY, sequence_workers_key
from asyncinfer.wire.sequence import sequence_of
from asyncinfer.worker.requests.taken import TakenMessage
from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["SequencePins", "lost_error"]

log = logging.getLogger(__name__)

_REGISTER = script("sequence_register")
_LAPSED = script("sequence_lapsed")

#: The refusals of one sweep: (the taken requests, the error of each).
Refuse = Callable[[list[Popped], Callable[[TakenMessage, Mapping[str, Any]], BaseException]], None]


def lost_error(model: str, pin: str, request_id: str, v2: Mapping[str, Any]) -> SequenceStateLost:
    """The error of request ``request_id`` (its request ``v2``) of ``model``, pushed onto the own
    list of the worker a lapsed ``pin`` names: its sequence's state is lost."""
    try:
        sequence = sequence_of(v2.get("parameters") if v2 else None)
    except Exception:  # noqa: BLE001 - its sequence cannot be named; its error still says why
        sequence = None
    which = f"sequence {sequence.shown}" if sequence is not None else "its sequence"
    return SequenceStateLost(
        f"request {request_id}: the state of {which} of model '{model}' is lost: its worker "
        f"{worker_of_pin(pin)} stopped before running this request (it died, stopped, or "
        f"unloaded the model); start the sequence again (sequence_start)")


class SequencePins:
    """One worker's registrations for the sequences of its stateful models, and the sweep.

    ``client``: its own Redis connection; ``holder``: the worker's lease holder; ``taker`` and
    ``lease``: how a sweep takes a lapsed list's requests (leased to this worker);
    ``refuse``: fails them (the pipeline's :meth:`~asyncinfer.worker.pipeline.Pipeline.refuse`).
    """

    #: Most requests one sweep takes from a lapsed list at a time.
    sweep_batch = 100

    def __init__(self, client: redis.Redis, runtime: WorkerRuntime, *, holder: str,
                 lease_s: float, taker: Taker, lease: LeaseTerms | None, refuse: Refuse,
                 sweep_every_s: float = 1.0) -> None:
        self.client = client
        self.runtime = runtime
        self.holder = holder
        self.lease_s = lease_s
        self.taker = taker
        self.lease = lease
        self.refuse = refuse
        self.sweep_every_s = min(sweep_every_s, lease_s / 3)
        #: A lapsed registration whose list stayed empty this long is removed (s).
        self.grace_s = 3 * lease_s
        self._register = client.register_script(_REGISTER)
        self._lapsed = client.register_script(_LAPSED)
        #: A member names its list as Redis holds it: the publish script pushes there (keyspace.py).
        self._space = keyspace(client)
        #: Model → its registration member, for the stateful models this worker serves now.
        self.members: dict[str, str] = {}
        #: The members registered (and not lapsed since, as far as this worker knows).
        self._registered: set[str] = set()
        #: Model → when (monotonic) its lapsed registration may be renewed (:meth:`renew`).
        self._rejoin: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = vital_thread(self._run, "asyncinfer-sequences")
        #: Requests failed by this worker's sweeps (their sequence's worker was gone).
        self.failed = 0

    def lists_for(self, queues: list[str]) -> list[str]:
        """The own lists of the stateful models of ``queues`` (loaded here), and from now on the
        registrations of exactly those models (registered at the next renewal; call
        :meth:`renew` to register now)."""
        stateful = {r.model.name: r.sequences.spec.idle_timeout_s for r in self.runtime.runners()
                    if r.sequences is not None}
        members = {}
        for queue in queues:
            model = model_from_queue(queue)
            if model in stateful:
                members[model] = (f"{self._space.key(sequence_list(queue, self.holder))}\t"
                                  f"{self.holder}\t"
                                  f"{stateful[model]:g}")
        with self._lock:
            gone = {m: v for m, v in self.members.items() if m not in members}
            self.members = members
        if gone:
            self._send(gone, lapse=True)
        return [sequence_list(queue_for(m), self.holder) for m in members]

    def start(self) -> SequencePins:
        self.renew()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Lapse every registration now (the publish script refuses their sequences from now
        on; what the lists still hold is failed by the other workers' sweeps)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            members, self.members = self.members, {}
        try:
            self._send(members, lapse=True)
        except redis.RedisError as exc:
            log.warning("sequences: could not lapse this worker's registrations (%s); they lapse "
                        "within %g s", exc, self.lease_s)

    def renew(self) -> None:
        """Register (again) for every stateful model served now, until a lease from now."""
        with self._lock:
            members = dict(self.members)
        self._send(members, lapse=False)

    def _send(self, members: Mapping[str, str], lapse: bool) -> None:
        if not lapse:
            members = {m: v for m, v in members.items() if self._may_rejoin(m)}
        if not members:
            return
        models = list(members)
        known = ["1" if not lapse and members[m] in self._registered else "" for m in models]
        lapsed = {_text(m) for m in self._register(
            keys=[SEQUENCE_MODELS_KEY, *(sequence_workers_key(m) for m in models)],
            args=[0 if lapse else self.lease_s, *(members[m] for m in models), *models,
                  *known])}
        for model in models:
            if lapse:
                self._registered.discard(members[model])
            elif model in lapsed:
                self._registered.discard(members[model])
                self._rejoin[model] = time.monotonic() + self.lease_s / 3
                log.warning("sequences: this worker's registration for model %s lapsed (it was "
                            "frozen or cut off past the %g s lease): what it held was failed as "
                            "lost; it registers again once it ran what it holds", model,
                            self.lease_s)
            else:
                self._registered.add(members[model])
                self._rejoin.pop(model, None)

    def _may_rejoin(self, model: str) -> bool:
        """Whether ``model``'s registration may be renewed: not lapsed, or lapsed a renewal
        period ago with nothing of its sequences in flight here (their results are stored and
        the state of the requests failed meanwhile taken back)."""
        after = self._rejoin.get(model)
        if after is None:
            return True
        return time.monotonic() >= after and not any(
            r.sequences.busy() for r in self.runtime.runners()
            if r.sequences is not None and r.model.name == model)

    def sweep(self) -> int:
        """Fail what the lists of lapsed registrations hold (other workers'); how many."""
        flat = self._lapsed(keys=[SEQUENCE_MODELS_KEY],
                            args=[self._space.key(sequence_workers_key("")), self.grace_s])
        failed = 0
        own = set(self.members.values())
        for i in range(0, len(flat), 2):
            model, pin = _text(flat[i]), _text(flat[i + 1])
            if pin in own:
                continue
            taken = self.taker.take([self._space.name(pin.split("\t", 1)[0])], self.sweep_batch,
                                    lease=self.lease)
            if not taken:
                continue
            self.refuse(taken, functools.partial(_lost_error_of, model, pin))
            failed += len(taken)
        if failed:
            self.failed += failed
            log.warning("failed %d requests of sequences whose worker is gone (their state is "
                        "lost)", failed)
        return failed

    def _run(self) -> None:
        backoff = Backoff()
        renew_every_s = self.lease_s / 3
        since_renewal = 0.0
        while not self._stopped.wait(self.sweep_every_s):
            try:
                if not self.members:  # only the workers serving sequences sweep
                    continue
                since_renewal += self.sweep_every_s
                if since_renewal >= renew_every_s:
                    since_renewal = 0.0
                    self.renew()
                self.sweep()
                for runner in self.runtime.runners():
                    if runner.sequences is not None:
                        runner.sequences.expire()
                backoff.reset()
            except redis.RedisError as exc:
                wait_s = backoff.failed()
                log.warning("sequences: Redis failed (%s: %s); again in %.1f s",
                            type(exc).__name__, exc, wait_s)
                self._stopped.wait(wait_s)
            except Exception:  # noqa: BLE001 - the registration must outlive whatever goes wrong
                log.exception("sequences: unexpected error")


def _lost_error_of(model: str, pin: str, d: TakenMessage,
                   v2: Mapping[str, Any]) -> SequenceStateLost:
    return lost_error(model, pin, d.request_id, v2)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
