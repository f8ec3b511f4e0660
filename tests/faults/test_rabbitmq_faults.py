"""Faults of RabbitMQ itself and of the network to it, real processes: a worker partitioned from
RabbitMQ while it holds requests, and RabbitMQ's memory and disk alarms (publishers blocked).

**Partition.** The cut worker reaches RabbitMQ through a TCP proxy (tests/support/proxy.py) that
stops forwarding without a reset, as a dead link does; a second worker is connected directly;
results (and the "gated" model's records of what ran) go to a Redis database both still reach.
RabbitMQ gives back what a connection held once it sees it dead: when no data came on it for two
to three heartbeat intervals. At the shipped defaults Celery asks for 120 s (``broker_heartbeat``)
and RabbitMQ offers 60 s (``heartbeat`` in rabbitmq.conf), so 60 s is agreed and a cut worker's
requests come back about 3 minutes after the cut (174-176 s measured here; the worker itself
notices at 2 intervals, ~137 s, then reconnects with Celery's backoff, 2 s longer each try). A
test cannot wait that long: the cut worker's broker URL says what a user who wants faster
redelivery sets, ``?heartbeat=4`` (kombu reads it): given back 8-12 s after the cut. Its device
frees during the cut (what it held is finished, stored, given back and acknowledged unrun) or
after the path healed (what it held is given back and run elsewhere; the cut worker, once it sees
its connection dead, gives up what it had not started, so only the batch that was on its device
runs a second time: at least once). The path heals once the cut worker saw its connection dead: a
heal before that (a partition about as long as the worker's detection) lets TCP hand it what
RabbitMQ pushed into the connection before closing it, and it runs that although RabbitMQ gave it
to the other worker (docs/delivery.md: not handled).

**Alarms.** While a memory or disk alarm is raised, RabbitMQ stops reading from every connection
that publishes (consumers, acknowledgements included, go on). A submit wrote its request into the
socket and said it was sent, to be taken whenever the alarm clears, and a large one failed with
kombu's own error after a write timeout; now the client reads RabbitMQ's ``connection.blocked``
and refuses with BrokerRefused within ``timeout_s`` (``submit_timeout_s``, 0: at once). An alarm
is the whole node's: it is raised under an inter-process lock (tests/support/amqp.py,
``node_lock``) that every test of this file holds, kept a few seconds, and the setting found
before is restored in a ``finally``.

Skips when no RabbitMQ listens on 127.0.0.1:5672 or ``rabbitmqctl`` cannot drive it. The models are
named after the run, so their queues are the run's own; they are deleted at the end.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator

import pytest

from asyncinfer.client import Client
from asyncinfer.errors import BrokerRefused
from tests.support.amqp import (
    AMQP_HOST,
    AMQP_PORT,
    AMQP_URL,
    EventTap,
    amqp_url,
    model_of_run,
    node_lock,
    others_consuming,
    queue_consumers,
    queue_depth,
    rabbitmq_listens,
    rabbitmqctl_missing,
    resource_alarm,
)
from tests.support.databases import RedisDatabase, gated_executions
from tests.support.paced import index_input
from tests.support.processes import launch_worker, ready_together, start_worker
from tests.support.proxy import Partition
from tests.support.waiting import wait_for

RUN = uuid.uuid4().hex[:8]
GATED = "tests.support.models:Gated"
#: The cut worker's AMQP heartbeat (seconds), in its broker URL: RabbitMQ sees it dead in 2-3 of them.
HEARTBEAT_S = 4
#: How long an alarm test waits for other tests' workers on the node to finish, then skips.
QUIET_WAIT_S = 150
#: What Celery's consumer logs when it sees its connection to the broker dead.
LOST_CONNECTION = "consumer: Connection to broker lost"
#: What the direct worker logs for a redelivered request whose result is already stored.
ANSWERED_BEFORE = re.compile(r"request (\S+) was redelivered but its result \(\w+\) is already stored")


@pytest.fixture(scope="module")
def _rabbitmqctl() -> str | None:
    """Why rabbitmqctl cannot drive the RabbitMQ here (None: it can), asked once."""
    return rabbitmqctl_missing() if rabbitmq_listens() else None


@pytest.fixture(autouse=True)
def _rabbitmq(_rabbitmqctl: str | None, request: pytest.FixtureRequest) -> Iterator[None]:
    """Skip without a RabbitMQ and its rabbitmqctl; hold the node's lock for the whole test:
    exclusive for an alarm's test, shared for the others (an alarm must not meet another test
    that uses RabbitMQ, in this process or another)."""
    if not rabbitmq_listens():
        pytest.skip(f"no RabbitMQ listening on {AMQP_HOST}:{AMQP_PORT}")
    if _rabbitmqctl:
        pytest.skip(_rabbitmqctl)
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    with node_lock(shared="resource" not in params):
        yield


@pytest.fixture()
def model(request: pytest.FixtureRequest) -> Iterator[str]:
    """A "gated" model name of this test and run (its queue is deleted at the end)."""
    with model_of_run("gated", RUN) as name:
        yield name


def _gated_env(results: str, model: str, broker: str, prefix: str) -> dict[str, str]:
    """A worker's environment: ``broker``, ``results`` the result backend, ``model`` the "gated"
    test model recording its runs under ``prefix``; nothing else set (the shipped defaults)."""
    return {"ASYNCINFER_BROKER_URL": broker, "ASYNCINFER_RESULT_BACKEND": results,
            "ASYNCINFER_MODEL_FACTORIES": f"{model}={GATED}", "GATED_REDIS_URL": results,
            "GATED_PREFIX": prefix}


def _ran(r, *prefixes: str) -> dict[int, int]:
    """Index → how often the model ran it, on any of the workers of ``prefixes``."""
    ran: dict[int, int] = {}
    for prefix in prefixes:
        for i, n in gated_executions(r, prefix).items():
            ran[i] = ran.get(i, 0) + n
    return ran


def _tracebacks(log: str) -> list[str]:
    """The log's records that hold a traceback, less Celery's own report of the dead socket it
    read while cleaning up after its event loop (kombu's hub closing on the lost connection; the
    worker connects again and serves on)."""
    records = re.split(r"(?m)^(?=\[?\d{4}-\d\d-\d\d )", log)
    return [r for r in records
            if "Traceback" in r and "Error cleaning up after event loop" not in r]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("frees", ["during_cut", "after_heal"])
def test_a_partitioned_worker_gives_back_what_it_held(redis_db: RedisDatabase, model: str,
                                                      frees: str, tmp_path) -> None:
    # Given two workers of one model: the first reaches RabbitMQ through a proxy (heartbeat
    # HEARTBEAT_S in its URL), the second directly; the first's device blocked (its gate closed)
    url, r = redis_db.url, redis_db.client
    cut, direct = f"cut-{RUN}", f"direct-{RUN}"
    r.set(f"{cut}:gate", "closed")
    proxy = Partition(AMQP_PORT)
    tap = EventTap().start()
    first = launch_worker(url, tmp_path / "cut.log", "--device", "cpu", "--models", model,
                          "--hostname", f"{cut}@%h",
                          **_gated_env(url, model, amqp_url(proxy.port, heartbeat=HEARTBEAT_S), cut))
    second = launch_worker(url, tmp_path / "direct.log", "--device", "cpu", "--models", model,
                           "--hostname", f"{direct}@%h", **_gated_env(url, model, AMQP_URL, direct))
    client = Client(broker_url=AMQP_URL, result_backend=url)
    queue = f"infer.{model}"
    futures: list = []
    sent_at: dict[str, float] = {}
    answered_at: dict[str, float] = {}

    def send(i: int) -> None:
        future = client.submit(model, index_input(i))
        sent_at[future.id] = time.monotonic()
        future.add_done_callback(lambda f: answered_at.setdefault(f.id, time.monotonic()))
        futures.append(future)

    try:
        ready_together([first, second])
        # one request each: the second answers its own, the first's blocks on its device
        send(0)
        send(1)
        wait_for(lambda: r.exists(f"{cut}:blocked") and sum(f.done() for f in futures) == 1, 30,
                 "the first worker's device blocked, the second's request answered", poll_s=0.05)
        on_device = next(i for i, f in enumerate(futures) if not f.done())
        # then 18 more: the second answers its share at once, the first's wait for its device
        for i in range(2, 20):
            send(i)
        done_counts: list[int] = []

        def held_by_first() -> list[str]:
            # settled: no answer for a second, and what is not answered is the first's to
            # acknowledge (on a loaded host an answer can reach its future after the second's
            # acknowledgement reached RabbitMQ: asked again until the two agree)
            done_counts.append(sum(1 for f in futures if f.done()))
            settled = len(done_counts) > 10 and len(set(done_counts[-10:])) == 1
            if not settled:
                return []
            unanswered = [f.id for f in futures if not f.done()]
            return unanswered if queue_depth(queue) == (0, len(unanswered)) else []

        held = wait_for(held_by_first, 30, "the first worker holding what is not answered, "
                        "RabbitMQ holding it unacknowledged", poll_s=0.1)

        # When the first's path to RabbitMQ is cut (no reset: a dead link) and 20 more requests
        # are sent during the cut; its device frees 1.5 s after the cut (it finishes what it held
        # and stores the results, reaching Redis still, but cannot acknowledge them) or only once
        # the path healed
        proxy.cut()
        cut_at = time.monotonic()
        for i in range(20, 40):
            send(i)
            time.sleep(0.05)
        if frees == "during_cut":
            time.sleep(max(0.0, cut_at + 1.5 - time.monotonic()))
            r.delete(f"{cut}:gate")

        # Then every request is answered with its own value, each run once: what the first
        # finished during the cut was given back and acknowledged without running again; what it
        # had not finished, and what RabbitMQ had pushed to the dead connection, was given back
        # and run by the second
        answers = [f.result(timeout=60) for f in futures]
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(40)]
        wait_for(lambda: queue_depth(queue) == (0, 0), 60,
                 f"nothing left on {queue}, unacknowledged included", poll_s=1.0)
        settled_s = time.monotonic() - cut_at
        ran = _ran(r, cut, direct)
        by_first = {a.id for a in answers if str(a.parameters["worker"]).startswith(cut)}
        during_cut = [f.id for f in futures[20:]]
        # pushed to the cut connection and given back once RabbitMQ closed it: answered late.
        # RabbitMQ closes it after two heartbeats without a frame, counted from the last frame
        # it had, which may be up to one interval before the cut: as soon as ~HEARTBEAT_S after
        # the cut. One sent straight to the second worker is answered within milliseconds.
        given_back = [i for i in during_cut if i not in by_first
                      and answered_at[i] - sent_at[i] > HEARTBEAT_S / 2]
        skipped = set(ANSWERED_BEFORE.findall(second.log()))
        counts = {"sent": len(futures), "answered": len(answers), "lost": 40 - len(answers),
                  "ran_twice": sum(1 for n in ran.values() if n > 1),
                  "held_at_cut": len(held),
                  "finished_by_cut_worker": len(by_first & set(held)),
                  "redelivered_acked_without_running": len(skipped),
                  "sent_during_cut": len(during_cut),
                  "pushed_to_cut_worker_given_back": len(given_back),
                  "first_given_back_answer_s": round(min(
                      (answered_at[i] - cut_at for i in [*given_back, *held] if i not in by_first),
                      default=-1.0), 2),
                  "to_last_answer_s": round(max(answered_at.values()) - cut_at, 2),
                  "queue_settled_s": round(settled_s, 2)}
        print(f"RabbitMQ, a worker partitioned while it holds requests (device frees {frees}):",
              counts)
        assert ran == {i: 1 for i in range(40)}, counts
        assert given_back, counts
        if frees == "during_cut":
            assert held and set(held) <= by_first and skipped == set(held), counts
        else:
            assert not by_first & set(held) and not skipped, counts

        # When the path heals (and the first's device frees now, if it did not), once the first
        # saw its connection dead (a heal before that lets TCP hand it what RabbitMQ pushed into
        # the dead connection: a partition shorter than the worker's detection, not this test's)
        wait_for(lambda: LOST_CONNECTION in first.log(), 60,
                 "the cut worker seeing its connection to RabbitMQ dead", poll_s=0.2)
        proxy.heal()
        healed_at = time.monotonic()
        wait_for(lambda: queue_consumers(queue) == 2, 60, "the cut worker consuming again",
                 poll_s=0.5)
        reconnected_s = time.monotonic() - healed_at
        r.delete(f"{cut}:gate")
        # Then both workers serve what comes next, and the first's task events go out again
        later = [client.submit(model, index_input(i)) for i in range(40, 80)]
        answers = [f.result(timeout=60) for f in later]
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(40, 80)]
        later_by_first = {a.id for a in answers if str(a.parameters["worker"]).startswith(cut)}
        wait_for(lambda: later_by_first <= tap.of("task-succeeded", cut), 10,
                 "the cut worker's task-succeeded events of what it answered after the heal")
        twice = {i for i, n in _ran(r, cut, direct).items() if n > 1}
        after = {"sent": 40, "answered": len(answers), "by_cut_worker": len(later_by_first),
                 "by_other": 40 - len(later_by_first),
                 "reconnected_after_heal_s": round(reconnected_s, 2),
                 "ran_twice_in_all": len(twice)}
        print("RabbitMQ, after the partition healed:", after, "ran twice:", sorted(twice))
        assert 0 < len(later_by_first) < 40, after
        assert not _tracebacks(first.log()), first.log()[-3000:]
        # And nothing ran twice, but the batch that was on the cut worker's device when the path
        # healed: it runs on (at least once); what waited behind it is given up
        if frees == "during_cut":
            assert not twice, after
        else:
            assert twice <= {on_device}, (f"after a partition the worker ran what it held from "
                                          f"the lost connection and had not started (RabbitMQ "
                                          f"gave it to another worker): {after}")
    finally:
        r.delete(f"{cut}:gate")
        client.close()
        proxy.close()
        tap.close()
        first.stop()
        second.stop()


@pytest.mark.timeout(QUIET_WAIT_S + 90)
@pytest.mark.parametrize("resource", ["memory", "disk"])
def test_a_submit_while_rabbitmq_blocks_publishing_is_refused(redis_db: RedisDatabase, model: str,
                                                              resource: str, tmp_path) -> None:
    # Given a worker holding 10 requests sent before the alarm (its device blocked)
    url, r = redis_db.url, redis_db.client
    prefix = f"alarm-{resource}-{RUN}"
    r.set(f"{prefix}:gate", "closed")
    worker = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", model,
                          "--hostname", f"{prefix}@%h", **_gated_env(url, model, AMQP_URL, prefix))
    client = Client(broker_url=AMQP_URL, result_backend=url)
    refused: dict[int, tuple[float, BrokerRefused]] = {}
    in_flight: dict[int, object] = {}
    try:
        before = [client.submit(model, index_input(i)) for i in range(10)]
        wait_for(lambda: r.exists(f"{prefix}:blocked"), 30, "the worker's device blocked")
        # (an alarm blocks every publisher of the node: not while another test's workers serve,
        # as tests/faults/test_rabbitmq_fleet.py's may in the other process of `make test`)
        try:
            wait_for(lambda: not others_consuming({f"infer.{model}"}), QUIET_WAIT_S,
                     "no other test's workers on this RabbitMQ", poll_s=2.0)
        except TimeoutError:
            pytest.skip(f"other workers kept consuming on this RabbitMQ for {QUIET_WAIT_S} s "
                        f"({', '.join(others_consuming({f'infer.{model}'}))}); an alarm would "
                        f"block their publishers")
        # When RabbitMQ raises its alarm (every publishing connection blocked) and the device frees
        with resource_alarm(resource):
            alarm_at = time.monotonic()
            r.delete(f"{prefix}:gate")
            # Then what was sent before the alarm is answered during it (consumers are not blocked)
            answered_before = [f.result(timeout=30) for f in before]
            answered_s = time.monotonic() - alarm_at
            # And a submit during it ends with BrokerRefused at once (submit_timeout_s 0), naming
            # the request and the cause; RabbitMQ tells a connection it is blocked only once it
            # published, so the first one (or two) goes out: taken once the alarm clears
            for i in range(10, 16):
                started = time.monotonic()
                try:
                    future = client.submit(model, index_input(i), request_id=f"{prefix}-{i}")
                    future.sent()
                    in_flight[i] = future
                except BrokerRefused as exc:
                    refused[i] = (time.monotonic() - started, exc)
                time.sleep(0.1)
            # ... and with a submit's timeout_s, once that has passed
            started = time.monotonic()
            with pytest.raises(BrokerRefused, match=rf"request {prefix}-16: RabbitMQ blocks "
                                                    rf"publishing \(low on {resource}"):
                client.submit(model, index_input(16), request_id=f"{prefix}-16", timeout_s=1.0)
            waited_s = time.monotonic() - started
        cleared_at = time.monotonic()
        # And once the alarm clears, a refused request submitted again with its ID is sent and
        # answered, as are new ones and those that were in flight
        again = {i: client.submit(model, index_input(i), request_id=f"{prefix}-{i}")
                 for i in [*refused, 16]}
        after = {i: client.submit(model, index_input(i)) for i in range(17, 20)}
        futures = {**in_flight, **again, **after}
        answers = {i: f.result(timeout=30) for i, f in futures.items()}  # type: ignore[attr-defined]
        to_last_answer_s = time.monotonic() - cleared_at
        ran = _ran(r, prefix)
        counts = {"queued_before": len(before), "answered_during_alarm": len(answered_before),
                  "answered_during_alarm_s": round(answered_s, 2),
                  "submitted_during_alarm": 7, "refused": len(refused) + 1,
                  "in_flight": len(in_flight),
                  "slowest_refusal_s": round(max(t for t, _ in refused.values()), 4),
                  "refused_with_timeout_1s_s": round(waited_s, 2),
                  "sent_after_clear": len(again) + len(after),
                  "answered_after_clear": len(answers),
                  "ran_twice": sum(1 for n in ran.values() if n > 1),
                  "to_last_answer_after_clear_s": round(to_last_answer_s, 2)}
        print(f"RabbitMQ, {resource} alarm:", counts)
        print("  the refusal:", next(iter(refused.values()))[1] if refused else None)
        assert len(in_flight) <= 2 and len(refused) == 6 - len(in_flight), counts
        assert counts["slowest_refusal_s"] < 0.5 and 1.0 <= waited_s < 2.0, counts
        for i, (_, exc) in refused.items():
            assert f"request {prefix}-{i}: RabbitMQ blocks publishing (low on {resource}" in str(exc)
        assert {i: a["output"].tolist() for i, a in answers.items()} == {
            i: [[float(i)]] for i in futures}
        assert ran == {i: 1 for i in [*range(10), *futures]}, counts
    finally:
        r.delete(f"{prefix}:gate")
        client.close()
        worker.stop()
