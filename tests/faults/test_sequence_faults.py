"""A stateful model's sequences when the worker holding them is killed, frozen or stopped, at the
SHIPPED defaults: ``ASYNCINFER_LEASE_S`` unset (10 s) and the model's sequence idle timeout its
default (60 s, models/sequence.py).

Two real workers host ``accumulator`` (:class:`DefaultAccumulator`: the tests' running sum per
sequence, tests/support/sequence_models.py, at the default idle timeout, marking each batch it
starts per worker and holding it while its worker's gate is closed), with a gateway, on a Redis
database of their own, started side by side once and shared by the module's tests: the worker a
test faults is replaced (by a fresh one, under a new name) before the next test, and each test
opens sequences of IDs no test used before. Six sequences are opened across the two workers (a
START and two more requests each), then the fault hits the worker holding some of them (the
victim):

- kill -9 with a batch held on its device and more queued behind it: all of them, and what is sent
  after the kill, fail with SequenceStateLost (409 over the gateway) within the lease and a sweep;
- SIGSTOP past the lease: what is sent meanwhile fails, its sequences go on after the thaw without
  it (documented); with a batch on its device at the freeze, that batch runs after the thaw, but its
  results never replace the failures already stored and the state it left is taken back;
- SIGTERM with its device let go at once (what it held is answered on the right state), and with
  its device stuck past the stop's grace (what it held fails with the state lost).

Every answer's SUM is checked against the running sum of the requests of its sequence that were
answered before it, so a request run on a fresh (or any wrong) state is counted, never missed;
each worker's forward marks show where each request ran. Each test prints sent / answered /
failed with the state lost / ran on a wrong state and the seconds from the fault to the last
answer (``pytest -s`` shows them).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kombu.utils import json as kombu_json

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import SequenceStateLost
from asyncinfer.models.base import Batch
from asyncinfer.models.sequence import DEFAULT_IDLE_TIMEOUT_S, SequenceBatching, SequenceState
from asyncinfer.wire.keys import sequence_workers_key
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks, mark_forward, marks_client
from tests.support.processes import (
    TEST_FACTORIES,
    GatewayProcess,
    WorkerProcess,
    launch_gateway,
    launch_worker,
    ready_together,
    stop_together,
)
from tests.support.sequence_models import Accumulator
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

MODEL = "accumulator"
#: A worker's gate: while ``<GATE_PREFIX><its pid>`` is ``closed`` its batches wait on the device.
GATE_PREFIX = "test:seqgate:"
#: The shipped lease (ASYNCINFER_LEASE_S unset), read from the settings' default.
LEASE_S: float = Settings.from_env({}).lease_s
#: A lease plus a sweep, and room for a loaded two-core host.
STATE_LOST_WITHIN_S = LEASE_S + 5


class DefaultAccumulator(Accumulator):
    """The tests' accumulator with the default sequence idle timeout (none given), marking each
    batch it starts under ``accumulator:<pid>`` and waiting while this worker's gate is closed."""

    sequence_batching = SequenceBatching(
        start="START", end="END", ready="READY", corrid="CORRID", corrid_datatype="BYTES",
        state=SequenceState("ACC", "ACC_OUT", (1,), "INT64"))

    def __init__(self) -> None:
        super().__init__()
        self.marks = marks_client()

    def forward(self, batch: Batch) -> Batch:
        mark_forward(self.marks, f"{MODEL}:{os.getpid()}", batch["INPUT"].reshape(-1).tolist())
        if self.marks is not None:
            while self.marks.get(f"{GATE_PREFIX}{os.getpid()}") == b"closed":
                time.sleep(0.01)
        return super().forward(batch)


def _launch(db: RedisDatabase, logs: Path, name: str) -> WorkerProcess:
    """A worker of the accumulator named ``name``, at the shipped lease and idle timeout
    (worker_env drops every ASYNCINFER_* of this process's environment), not waited for."""
    return launch_worker(
        db.url, logs / f"{name}.log", "--device", "cpu", "--models", MODEL,
        "--hostname", f"{name}@%h",
        ASYNCINFER_MODEL_FACTORIES=(f"{TEST_FACTORIES},{MODEL}="
                                    f"{__name__}:{DefaultAccumulator.__name__}"),
        **{FORWARD_MARKS_ENV: db.url})


@dataclass
class Fleet:
    db: RedisDatabase
    workers: dict[str, WorkerProcess]  # by the name an answer's ``worker`` parameter gives
    gateway: GatewayProcess
    client: Client
    logs: Path
    #: Sequence IDs never used before in this module (its tests share the workers, so each test's
    #: sequences are its own: none is pinned already when the test starts it).
    next_sequence: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    #: Workers started in place of one a test faulted (for their names).
    replacements: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    #: The workers the running test faults (its victim): replaced before the next test.
    faulted: set[str] = field(default_factory=set)

    def sequences(self, count: int) -> list[int]:
        return [next(self.next_sequence) for _ in range(count)]

    def other(self, name: str) -> str:
        return next(n for n in self.workers if n != name)

    def gate(self, name: str, closed: bool) -> None:
        key = f"{GATE_PREFIX}{self.workers[name].pid}"
        if closed:
            self.db.client.set(key, "closed")
        else:
            self.db.client.delete(key)

    def marks(self, name: str) -> ForwardMarks:
        return ForwardMarks(self.db.client, f"{MODEL}:{self.workers[name].pid}")

    def live_workers(self) -> list[str]:
        """The registrations of the model's sequence workers that have not lapsed (their
        members, on Redis' clock)."""
        r = self.db.client
        seconds, micros = r.time()
        now = seconds + micros / 1e6
        return [m.decode() for m in r.zrangebyscore(sequence_workers_key(MODEL), now, "+inf")]

    def registered(self, name: str) -> bool:
        pid = f" {self.workers[name].pid} "
        return any(pid in member for member in self.live_workers())

    def serving(self) -> bool:
        """Whether exactly this fleet's two workers are registered (none lapsed or lapsing)."""
        live = self.live_workers()
        return len(live) == len(self.workers) and all(self.registered(n) for n in self.workers)

    def restore(self) -> None:
        """Two fresh-enough workers again: each worker a test faulted (killed, frozen, stopped),
        and any other that died or is not registered, stopped by its PID and replaced by a fresh
        one under a new name, the replacements starting while it stops; then wait until only
        these two are registered."""
        host = os.uname().nodename
        retired = []
        for name, proc in list(self.workers.items()):
            if name not in self.faulted and proc.process.poll() is None and self.registered(name):
                continue
            retired.append(self.workers.pop(name))
            fresh = f"{name.split('@')[0].split('-r')[0]}-r{next(self.replacements)}"
            self.workers[f"{fresh}@{host}"] = _launch(self.db, self.logs, fresh)
        self.faulted.clear()
        stop_together(retired)  # of a dead one, only its log is closed
        ready_together(list(self.workers.values()))
        wait_for(self.serving, STATE_LOST_WITHIN_S, "only the fleet's two workers registered",
                 poll_s=0.05)


@pytest.fixture(scope="module")
def shared_fleet(redis_databases: RedisDatabases,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two workers of the accumulator at the shipped lease and idle timeout, a gateway and a
    client, on a database of this module's own, shared by its tests; all started side by side,
    every process stopped by its PID."""
    logs = tmp_path_factory.mktemp("sequence-faults")
    with redis_databases.take(__name__) as db:
        started: list[WorkerProcess] = []
        fleet: Fleet | None = None
        try:
            host = os.uname().nodename
            workers = {}
            for name in ("seq-a", "seq-b"):
                workers[f"{name}@{host}"] = _launch(db, logs, name)
                started.append(workers[f"{name}@{host}"])
            gateway = launch_gateway(db.url, logs / "gateway.log")
            started.append(gateway)
            ready_together(started)
            fleet = Fleet(db, workers, gateway, Client(broker_url=db.url), logs)
            yield fleet
        finally:
            if fleet is not None:
                fleet.client.close()
                started += fleet.workers.values()  # the replacements too
            stop_together(started)


@pytest.fixture()
def fleet(shared_fleet: Fleet) -> Iterator[Fleet]:
    """The module's fleet, both workers live and registered (the one an earlier test faulted
    replaced) and no gate closed; after the test, every gate opened and every worker thawed, so
    that a test that failed halfway leaves it usable."""
    shared_fleet.restore()
    try:
        yield shared_fleet
    finally:
        for name, proc in shared_fleet.workers.items():
            shared_fleet.gate(name, closed=False)
            if proc.process.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)


@dataclass
class Ledger:
    """Every request sent, and what its sequence's state must be: a request answered with a SUM
    other than the running sum of its sequence's answered requests ran on a wrong state."""

    client: Client
    sums: dict[int, int] = field(default_factory=dict)  # running sum of answered requests
    worker_of: dict[int, str] = field(default_factory=dict)
    sent: list[tuple[int, int, Future[Any]]] = field(default_factory=list)
    answered: int = 0
    lost: list[str] = field(default_factory=list)  # the messages of SequenceStateLost
    wrong_state: list[tuple[int, int, int, int]] = field(default_factory=list)
    other_errors: list[str] = field(default_factory=list)

    def send(self, sequence: int, value: int, *, start: bool = False) -> Future[Any]:
        parameters: dict[str, Any] = {"sequence_id": sequence}
        if start:
            parameters["sequence_start"] = True
        future = self.client.submit(MODEL, {"INPUT": np.array([[value]], np.int64)},
                                    parameters=parameters)
        self.sent.append((sequence, value, future))
        return future

    def settle(self, future: Future[Any], timeout_s: float = 60) -> str:
        """Wait for one request sent with :meth:`send` and account for it: 'answered', 'lost'
        or 'error'. Requests of one sequence must be settled in the order they were sent."""
        sequence, value = next((s, v) for s, v, f in self.sent if f is future)
        try:
            response = future.result(timeout=timeout_s)
        except SequenceStateLost as exc:
            self.lost.append(str(exc))
            return "lost"
        except Exception as exc:  # noqa: BLE001 - counted, and asserted on by the tests
            self.other_errors.append(f"{type(exc).__name__}: {exc}")
            return "error"
        got = int(response["SUM"][0, 0])
        expected = self.sums.get(sequence, 0) + value
        if got != expected:
            self.wrong_state.append((sequence, value, expected, got))
        self.sums[sequence] = got
        self.answered += 1
        worker = response.parameters["worker"]
        assert self.worker_of.setdefault(sequence, worker) == worker, (sequence, worker)
        return "answered"

    def round(self, sequences: list[int], value_of: Any, *, start: bool = False) -> list[str]:
        """One request of each sequence, sent together, settled in order."""
        futures = [self.send(s, value_of(s), start=start) for s in sequences]
        return [self.settle(f) for f in futures]


def _value(sequence: int, step: int) -> int:
    """A value no other request of the test sends (so a mark names its request)."""
    return 1000 * sequence + step


def _open_six(ledger: Ledger, fleet: Fleet) -> tuple[list[int], list[int], str]:
    """Six sequences, a START and two more requests each; (the victim's, the survivor's, the
    victim) with the victim the worker holding the first sequence."""
    sequences = fleet.sequences(6)
    for step in range(3):
        outcomes = ledger.round(sequences, lambda s, step=step: _value(s, step), start=step == 0)
        assert outcomes == ["answered"] * 6, ledger.other_errors
    assert not ledger.wrong_state
    victim = ledger.worker_of[sequences[0]]
    fleet.faulted.add(victim)  # the test faults it: the next test has a fresh one in its place
    on_victim = [s for s in sequences if ledger.worker_of[s] == victim]
    on_survivor = [s for s in sequences if ledger.worker_of[s] != victim]
    assert on_victim and on_survivor, ledger.worker_of  # both workers hold some
    return on_victim, on_survivor, victim


def _print_counts(fault: str, **counts: Any) -> None:
    print(f"\n{fault}: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items()))


def test_defaults_are_the_shipped_ones() -> None:
    # the faults below run at these: a lease of 10 s, a sequence idle timeout of 60 s
    assert LEASE_S == next(f.default for f in dataclasses.fields(Settings)
                           if f.name == "lease_s") == 10.0
    assert DefaultAccumulator.sequence_batching.idle_timeout_s == DEFAULT_IDLE_TIMEOUT_S == 60.0


def test_kill_9_with_requests_in_flight_fails_them_state_lost_and_the_survivor_goes_on(
        fleet: Fleet) -> None:
    ledger = Ledger(fleet.client)
    # Given six sequences open across two workers
    on_victim, on_survivor, victim = _open_six(ledger, fleet)
    survivor = fleet.other(victim)
    victim_proc = fleet.workers[victim]
    victim_marks, survivor_marks = fleet.marks(victim), fleet.marks(survivor)
    # and requests of the victim's sequences in flight: one batch held on its device, the next
    # request of each queued behind it
    fleet.gate(victim, closed=True)
    in_flight = [ledger.send(s, _value(s, 3)) for s in on_victim]
    victim_marks.wait_on_device(_value(on_victim[0], 3))
    in_flight += [ledger.send(s, _value(s, 4)) for s in on_victim]
    # When the victim is killed (kill -9)
    os.kill(victim_proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    victim_proc.process.wait(10)
    fleet.gate(victim, closed=False)
    # and each of its sequences is sent another request at once
    after_kill = [ledger.send(s, _value(s, 5)) for s in on_victim]
    # Then the survivor's sequences go on, exactly, meanwhile
    for step in (3, 4, 5):
        assert ledger.round(on_survivor, lambda s, step=step: _value(s, step)) == (
            ["answered"] * len(on_survivor)), ledger.other_errors
    # and every request of the victim's sequences in flight or sent after the kill fails with its
    # state lost, naming its sequence and the victim, within a lease and a sweep
    outcomes = [ledger.settle(f) for f in in_flight + after_kill]
    last_answer_s = time.monotonic() - killed_at
    assert outcomes == ["lost"] * len(outcomes), (outcomes, ledger.other_errors)
    assert last_answer_s < STATE_LOST_WITHIN_S
    pid = f"pid {victim_proc.pid}"
    for s in on_victim:
        named = [m for m in ledger.lost if f"state of sequence {s} of model '{MODEL}' is lost" in m]
        assert len(named) == 3 and all(pid in m and victim.split("@")[0] in m for m in named), (
            ledger.lost)
    # and once its registration lapsed, the next request of each is refused at once: 409 over
    # the gateway, SequenceStateLost from the client
    assert not fleet.registered(victim)
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(fleet.gateway.http_url, network_timeout=30)
    try:
        for s in on_victim:
            x = httpclient.InferInput("INPUT", [1, 1], "INT64")
            x.set_data_from_numpy(np.array([[_value(s, 6)]], np.int64))
            with pytest.raises(InferenceServerException) as refused:
                http.infer(MODEL, [x], sequence_id=s)
            assert refused.value.status() == "409", refused.value
            assert f"state of sequence {s} of model '{MODEL}' is lost" in str(refused.value)
            assert pid in str(refused.value)
    finally:
        http.close()
    refused_now = [ledger.settle(ledger.send(s, _value(s, 7))) for s in on_victim]
    assert refused_now == ["lost"] * len(on_victim)
    # and no request of the victim's sequences ran anywhere after the kill: neither on the survivor
    # nor on a fresh state; the one on the victim's device never finished
    survivor_rows = {v for batch in survivor_marks.batches() for v in batch}
    assert not survivor_rows & {_value(s, step) for s in on_victim for step in range(3, 8)}
    victim_rows = [v for batch in victim_marks.batches() for v in batch]
    assert all(v in {_value(s, 3) for s in on_victim} for v in victim_rows), victim_rows
    # and a new sequence starts on the survivor, and accumulates
    new = fleet.sequences(1)[0]
    assert ledger.round([new], lambda s: _value(s, 0), start=True) == ["answered"]
    assert ledger.round([new], lambda s: _value(s, 1)) == ["answered"]
    assert ledger.worker_of[new] == survivor
    assert not ledger.wrong_state and not ledger.other_errors, (ledger.wrong_state,
                                                                ledger.other_errors)
    assert all(ledger.sums[s] == sum(_value(s, k) for k in range(6)) for s in on_survivor)
    victim_sent = 5 * len(on_victim)  # in flight 2, after the kill 1, gateway 1, client 1
    _print_counts("kill -9", sequences_on_victim=len(on_victim),
                  sequences_on_survivor=len(on_survivor), victim_requests_sent=victim_sent,
                  answered=0, failed_state_lost=len(ledger.lost) + len(on_victim),
                  ran_on_wrong_state=len(ledger.wrong_state),
                  last_answer_s=f"{last_answer_s:.1f}", lease_s=LEASE_S,
                  survivor_requests_answered=3 * len(on_survivor), new_sequence="on the survivor")


def test_sigstop_past_the_lease_fails_what_was_sent_meanwhile_and_its_sequences_go_on(
        fleet: Fleet) -> None:
    ledger = Ledger(fleet.client)
    # Given six sequences open across two workers
    on_victim, on_survivor, victim = _open_six(ledger, fleet)
    victim_proc = fleet.workers[victim]
    # When the victim is frozen (SIGSTOP) with nothing in flight
    os.kill(victim_proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        # and each of its sequences is sent a request while it is frozen
        meanwhile = [ledger.send(s, _value(s, 3)) for s in on_victim]
        # Then the survivor's sequences go on
        for step in (3, 4):
            assert ledger.round(on_survivor, lambda s, step=step: _value(s, step)) == (
                ["answered"] * len(on_survivor))
        # and what was sent meanwhile fails with the state lost, naming the victim, within a
        # lease and a sweep of the freeze
        outcomes = [ledger.settle(f) for f in meanwhile]
        lost_after_s = time.monotonic() - frozen_at
        assert outcomes == ["lost"] * len(on_victim), (outcomes, ledger.other_errors)
        assert lost_after_s < STATE_LOST_WITHIN_S
        assert all(f"pid {victim_proc.pid}" in m for m in ledger.lost)
        assert not fleet.registered(victim)
        # held past the lease (the fault's length, not an ordering)
        time.sleep(max(0.0, LEASE_S + 1 - (time.monotonic() - frozen_at)))
    finally:
        os.kill(victim_proc.pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    frozen_s = thawed_at - frozen_at
    # When it is thawed: it registers again
    wait_for(lambda: fleet.registered(victim), LEASE_S + 5, "the thawed worker registered again",
             poll_s=0.05)
    registered_after_s = time.monotonic() - thawed_at
    # Then its sequences go on, without the requests that failed (documented: docs/sequences.md)
    for step in (4, 5):
        assert ledger.round(on_victim, lambda s, step=step: _value(s, step)) == (
            ["answered"] * len(on_victim)), ledger.other_errors
    assert all(ledger.worker_of[s] == victim for s in on_victim)
    for s in on_victim:
        assert ledger.sums[s] == sum(_value(s, k) for k in (0, 1, 2, 4, 5))
    for s in on_survivor:
        assert ledger.sums[s] == sum(_value(s, k) for k in range(5))
    assert not ledger.wrong_state and not ledger.other_errors
    _print_counts("SIGSTOP", frozen_s=f"{frozen_s:.1f}", sequences_on_victim=len(on_victim),
                  sent_while_frozen=len(meanwhile), failed_state_lost=len(ledger.lost),
                  lost_after_s=f"{lost_after_s:.1f}",
                  registered_again_after_thaw_s=f"{registered_after_s:.1f}",
                  answered_after_thaw=2 * len(on_victim),
                  ran_on_wrong_state=len(ledger.wrong_state))


class LostRequestRan(AssertionError):
    """A request whose caller was told its sequence's state was lost ran after all."""


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T of /proc/<pid>/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _held_batch_frozen_past_the_lease(fleet: Fleet) -> bool:
    """The SIGSTOP-with-a-batch-on-the-device fault, once; False when the victim was found
    running again before the test thawed it (a SIGCONT from outside the test: the fault did not
    happen, and what it held was rightly answered)."""
    ledger = Ledger(fleet.client)
    r = fleet.db.client
    # Given six sequences open across two workers
    on_victim, _, victim = _open_six(ledger, fleet)
    victim_proc = fleet.workers[victim]
    # and a request of each of the victim's sequences held on its device
    fleet.gate(victim, closed=True)
    victim_marks = fleet.marks(victim)  # before the sends: a batch marked first would not count
    held = [ledger.send(s, _value(s, 3)) for s in on_victim]
    victim_marks.wait_on_device(_value(on_victim[0], 3))
    # When the victim is frozen past the lease, its device let go (it sees that once thawed)
    os.kill(victim_proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: _stopped(victim_proc.pid), 5, "the victim stopped", poll_s=0.01)
        fleet.gate(victim, closed=False)
        # Then the held requests fail with their state lost, within a lease and a sweep
        outcomes = [ledger.settle(f) for f in held]
        lost_after_s = time.monotonic() - frozen_at
        if not _stopped(victim_proc.pid):
            print(f"\nthe victim (pid {victim_proc.pid}) was found running {lost_after_s:.1f} s "
                  f"after its SIGSTOP, before the test thawed it: outcomes {outcomes}")
            return False
        assert outcomes == ["lost"] * len(on_victim), (outcomes, ledger.other_errors)
        assert lost_after_s < STATE_LOST_WITHIN_S
        time.sleep(max(0.0, LEASE_S + 1 - (time.monotonic() - frozen_at)))  # the fault's length
    finally:
        os.kill(victim_proc.pid, signal.SIGCONT)
    # When it is thawed and registered again, and each sequence is sent its next request
    wait_for(lambda: fleet.registered(victim), LEASE_S + 5, "the thawed worker registered again",
             poll_s=0.05)
    after = [ledger.settle(ledger.send(s, _value(s, 4))) for s in on_victim]
    assert after == ["answered"] * len(on_victim), (after, ledger.other_errors)
    # Then a request its caller was told failed has not run: its stored state is still the
    # failure, and the sequences' state is as the failure left it
    stored = [kombu_json.loads(r.get(f"celery-task-meta-{f.id}"))["status"] for f in held]
    ran = [status for status in stored if status != "FAILURE"]
    _print_counts("SIGSTOP with a batch on the device", sequences_on_victim=len(on_victim),
                  held_on_device=len(held), failed_state_lost=outcomes.count("lost"),
                  lost_after_s=f"{lost_after_s:.1f}", stored_after_thaw=stored,
                  ran_on_wrong_state=len(ledger.wrong_state))
    if ran or ledger.wrong_state:
        raise LostRequestRan(
            f"{len(ran)} of {len(held)} requests failed with SequenceStateLost are stored "
            f"{ran} after the thaw; {len(ledger.wrong_state)} next requests answered on a "
            f"state that counts them (sequence, value, expected SUM, got): {ledger.wrong_state}")
    return True


def test_sigstop_with_a_batch_on_its_device_past_the_lease_never_runs_a_failed_request(
        fleet: Fleet) -> None:
    # The fault once more, on a fleet restored, when something outside the test resumed the
    # frozen victim (seen once in a loaded full-suite run: the held requests answered while the
    # victim was to be frozen, with no thaw of this test's)
    if not _held_batch_frozen_past_the_lease(fleet):
        for proc in fleet.workers.values():
            if proc.process.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        fleet.restore()
        assert _held_batch_frozen_past_the_lease(fleet), "the victim was resumed from outside twice"


def test_sigterm_with_requests_in_flight_never_runs_a_sequence_on_a_fresh_state(
        fleet: Fleet) -> None:
    ledger = Ledger(fleet.client)
    # Given six sequences open across two workers
    on_victim, on_survivor, victim = _open_six(ledger, fleet)
    victim_proc = fleet.workers[victim]
    survivor_marks = fleet.marks(fleet.other(victim))
    # and requests of the victim's sequences in flight: one batch on its device, the next three
    # requests of each queued behind it
    fleet.gate(victim, closed=True)
    victim_marks = fleet.marks(victim)  # before the sends: a batch marked first would not count
    on_device = [ledger.send(s, _value(s, 3)) for s in on_victim]
    victim_marks.wait_on_device(_value(on_victim[0], 3))
    queued = [ledger.send(s, _value(s, step)) for step in (4, 5, 6) for s in on_victim]
    # When it is stopped cleanly (SIGTERM), its device let go
    victim_proc.process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    fleet.gate(victim, closed=False)
    assert victim_proc.process.wait(30) == 0
    exited_s = time.monotonic() - stopped_at
    # Then each of its sequences' next request fails at once with the state lost
    after_stop = [ledger.send(s, _value(s, 7)) for s in on_victim]
    outcomes = {"on device": [ledger.settle(f) for f in on_device],
                "queued": [ledger.settle(f) for f in queued],
                "after the stop": [ledger.settle(f) for f in after_stop]}
    last_answer_s = time.monotonic() - stopped_at
    assert outcomes["after the stop"] == ["lost"] * len(on_victim), (outcomes,
                                                                      ledger.other_errors)
    # and what it held was either answered on its right state (the ledger checks each SUM) or
    # failed with the state lost, never anything else
    held = outcomes["on device"] + outcomes["queued"]
    assert set(held) <= {"answered", "lost"}, (outcomes, ledger.other_errors)
    assert last_answer_s < STATE_LOST_WITHIN_S
    # and nothing of the victim's sequences ran on the survivor
    survivor_rows = {v for batch in survivor_marks.batches() for v in batch}
    assert not survivor_rows & {_value(s, step) for s in on_victim for step in range(3, 8)}
    # and the survivor's sequences go on, exactly
    assert ledger.round(on_survivor, lambda s: _value(s, 3)) == ["answered"] * len(on_survivor)
    assert not ledger.wrong_state and not ledger.other_errors, (ledger.wrong_state,
                                                                ledger.other_errors)
    counts = {k: {o: v.count(o) for o in ("answered", "lost")} for k, v in outcomes.items()}
    _print_counts("SIGTERM", sequences_on_victim=len(on_victim),
                  victim_requests_sent=5 * len(on_victim), outcomes=counts,
                  failed_state_lost=len(ledger.lost), ran_on_wrong_state=len(ledger.wrong_state),
                  worker_exited_s=f"{exited_s:.1f}", last_answer_s=f"{last_answer_s:.1f}")


def test_sigterm_with_its_device_stuck_fails_what_it_held_state_lost(fleet: Fleet) -> None:
    ledger = Ledger(fleet.client)
    # Given six sequences open across two workers
    on_victim, on_survivor, victim = _open_six(ledger, fleet)
    victim_proc = fleet.workers[victim]
    survivor_marks = fleet.marks(fleet.other(victim))
    # and a batch of the victim's sequences stuck on its device (its gate stays closed), two more
    # requests of each queued behind it
    fleet.gate(victim, closed=True)
    victim_marks = fleet.marks(victim)  # before the sends: a batch marked first would not count
    on_device = [ledger.send(s, _value(s, 3)) for s in on_victim]
    victim_marks.wait_on_device(_value(on_victim[0], 3))
    queued = [ledger.send(s, _value(s, step)) for step in (4, 5) for s in on_victim]
    # When it is stopped cleanly (SIGTERM)
    victim_proc.process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    # and its sequences are sent another request while it stops
    while_stopping = [ledger.send(s, _value(s, 6)) for s in on_victim]
    # Then everything it held, and what was sent while it stopped, fails with the state lost once
    # its grace for the device (10 s) is over, plus a sweep
    outcomes = {"on device": [ledger.settle(f) for f in on_device],
                "queued": [ledger.settle(f) for f in queued],
                "while stopping": [ledger.settle(f) for f in while_stopping]}
    lost_after_s = time.monotonic() - stopped_at
    assert all(o == ["lost"] * len(o) for o in outcomes.values()), (outcomes,
                                                                     ledger.other_errors)
    assert lost_after_s < 10 + 5
    # and once it exited, the next request of each is refused at once
    assert victim_proc.process.wait(60) == 0
    exited_s = time.monotonic() - stopped_at
    after_exit = [ledger.settle(ledger.send(s, _value(s, 7))) for s in on_victim]
    assert after_exit == ["lost"] * len(on_victim)
    # and none of it ran on the survivor; the survivor's sequences go on, exactly
    survivor_rows = {v for batch in survivor_marks.batches() for v in batch}
    assert not survivor_rows & {_value(s, step) for s in on_victim for step in range(3, 8)}
    assert ledger.round(on_survivor, lambda s: _value(s, 3)) == ["answered"] * len(on_survivor)
    assert not ledger.wrong_state and not ledger.other_errors
    _print_counts("SIGTERM, device stuck", sequences_on_victim=len(on_victim),
                  victim_requests_sent=5 * len(on_victim), answered=0,
                  failed_state_lost=len(ledger.lost), ran_on_wrong_state=len(ledger.wrong_state),
                  last_lost_s=f"{lost_after_s:.1f}", worker_exited_s=f"{exited_s:.1f}")
