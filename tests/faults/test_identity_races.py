"""Races on a caller-chosen request ID (broker/publisher.py, wire/request_identity.py): the ID is
claimed with the request's identity in the one publish script, so however many producers send it
at the same moment, from however many processes, one request is queued and run.

Each race is gated: every producer process (a ``Client``, or the asyncinfer app's Celery
``send_task``) connects and publishes once elsewhere (warm), notes in Redis that it is ready and
blocks on a list; the test pushes one token per producer in one command, so all of them publish
at once. Several rounds per test, a new ID each. The races run with no worker on the database, so
the queue is counted exactly as the producers left it (one message per round, carrying the
winner's data); a worker started afterwards answers them. Through the gateway, the ``sleep``
model's forward marks (tests/support/marks.py) count the runs. Within one process (the gateway,
or threads of one ``Client``) the accepted request's waiters must still be answered when a
duplicate with other inputs is refused beside them (before c252080 a refusal unwatched every
waiter of its ID in the process: they waited forever).

Each test prints sent / accepted / refused / queued / ran / answered and the seconds from the
gate to the last answer (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from kombu.utils import json as kombu_json

from asyncinfer.supervision.processes import stop_process
from asyncinfer.wire.envelope import Message, decode_body, parse_envelope
from asyncinfer.wire.keys import CLAIM_PREFIX
from asyncinfer.wire.protocol import decode_request
from asyncinfer.wire.request_identity import identity
from tests.support.databases import RedisDatabase
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks
from tests.support.processes import (
    ROOT,
    GatewayProcess,
    WorkerProcess,
    launch_gateway,
    launch_worker,
    ready_together,
    start_worker,
    stop_together,
    worker_env,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

#: Rounds of each race (a new request ID each).
ROUNDS = 3
#: Where the producers publish once before the race (a queue no worker reads), so that each one's
#: connection and publish script are warm when the gate opens.
WARMUP_MODEL = "race-warmup"
REUSED = "this request ID was already sent with a different inputs"

# One producer process: argv[1] is its plan (JSON): the broker, the gate's key prefix, how it
# sends ("client": Client.submit(...).sent(); "celery": the asyncinfer app's send_task), the
# model, the input's name and datatype (and the output's name, if another), and per round
# [request ID, row of values]. It reports each round's outcome on the list <gate>:sent, and each
# accepted request's answer on <gate>:done.
PRODUCER = r"""
import json, os, sys, time
import numpy as np
import redis

plan = json.loads(sys.argv[1])
how, model, name, datatype = plan["how"], plan["model"], plan["input"], plan["datatype"]
output = plan.get("output", name)
dtype = {"INT32": np.int32, "FP32": np.float32}[datatype]
r = redis.Redis.from_url(plan["url"])
gate = plan["gate"]

def report(key, **fields):
    r.rpush(f"{gate}:{key}", json.dumps({"pid": os.getpid(), "how": how, **fields}))

def kwargs_of(model, values):
    return {"model": model, "inputs": [{"name": name, "datatype": datatype,
                                        "shape": [1, len(values)], "data": values}]}

if how == "client":
    from asyncinfer.client import Client
    client = Client(broker_url=plan["url"])
    client.submit(plan["warmup"], {name: np.zeros((1, 1), dtype)}).sent(timeout_s=30)
else:
    from asyncinfer import app
    app.send_task("asyncinfer.infer", kwargs=kwargs_of(plan["warmup"], [0]),
                  queue="infer." + plan["warmup"])
pending = []
for i, (rid, values) in enumerate(plan["rounds"]):
    r.incr(f"{gate}:{i}:ready")
    if not r.blpop([f"{gate}:{i}:go", f"{gate}:{i}:go:{plan['index']}"], timeout=60):
        sys.exit("the gate never opened")
    t0 = time.monotonic()
    try:
        if how == "client":
            handle = client.submit(model, {name: np.array([values], dtype)}, request_id=rid)
            handle.sent(timeout_s=30)
        else:
            handle = app.send_task("asyncinfer.infer", kwargs=kwargs_of(model, values),
                                   task_id=rid, queue="infer." + model)
    except Exception as exc:
        report("sent", round=i, rid=rid, values=values, accepted=False,
               error=type(exc).__name__, message=str(exc), publish_s=time.monotonic() - t0)
        continue
    report("sent", round=i, rid=rid, values=values, accepted=True,
           publish_s=time.monotonic() - t0)
    pending.append((i, rid, values, handle))
for i, rid, values, handle in pending:
    try:
        if how == "client":
            response = handle.result(timeout=60)
            outputs, parameters = response[output].reshape(-1).tolist(), dict(response.parameters)
        else:
            doc = handle.get(timeout=60)
            data = doc["outputs"][0]["data"]
            if isinstance(data, (bytes, bytearray)):
                data = np.frombuffer(data, dtype).tolist()
            outputs, parameters = list(data), doc["parameters"]
        report("done", round=i, rid=rid, values=values, outputs=outputs, parameters=parameters)
    except Exception as exc:
        report("done", round=i, rid=rid, values=values, error=type(exc).__name__,
               message=str(exc))
if how == "client":
    client.close()
"""


@dataclass
class Race:
    """Producer processes racing on one database, round by round."""

    db: RedisDatabase
    gate: str
    procs: list[subprocess.Popen[bytes]]
    count: int

    def reports(self, key: str) -> list[dict[str, Any]]:
        return [json.loads(v) for v in self.db.client.lrange(f"{self.gate}:{key}", 0, -1)]

    def run_rounds(self, rounds: int, first: dict[int, int] | None = None) -> float:
        """Open each round's gate once every producer waits at it, and wait for every producer's
        outcome of the round; the seconds from the first gate to the last outcome. ``first``:
        rounds that are no race — that producer (by index) alone, then, once it told its
        outcome, the others."""
        r, started = self.db.client, 0.0
        for i in range(rounds):
            wait_for(lambda i=i: self._ready(i), 60, f"{self.count} producers at gate {i}",
                     poll_s=0.02)
            if not started:
                started = time.monotonic()
            told = self.count * i
            others = self.count
            if first and i in first:
                r.rpush(f"{self.gate}:{i}:go:{first[i]}", "go")
                wait_for(lambda told=told: r.llen(f"{self.gate}:sent") > told, 60,
                         f"producer {first[i]}'s outcome of round {i}", poll_s=0.02)
                others -= 1
            r.rpush(f"{self.gate}:{i}:go", *["go"] * others)  # one command: all at once
            wait_for(lambda i=i: r.llen(f"{self.gate}:sent") >= self.count * (i + 1), 60,
                     f"every producer's outcome of round {i}", poll_s=0.02)
        return time.monotonic() - started

    def _ready(self, i: int) -> bool:
        alive = [p.poll() is None for p in self.procs]
        assert all(alive), f"a producer exited before the race: {[p.returncode for p in self.procs]}"
        return int(self.db.client.get(f"{self.gate}:{i}:ready") or 0) == self.count

    def finish(self, answers: int, timeout_s: float = 60) -> None:
        """Wait for ``answers`` answer reports and for every producer to exit cleanly."""
        wait_for(lambda: self.db.client.llen(f"{self.gate}:done") >= answers, timeout_s,
                 f"{answers} answers")
        for p in self.procs:
            assert p.wait(timeout_s) == 0, f"producer {p.pid} exited with {p.returncode}"


@pytest.fixture()
def start_race(redis_db: RedisDatabase, tmp_path: Path) -> Iterator[Any]:
    """Starts producer processes (each with its plan); stops each by its PID at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(plans: list[dict[str, Any]]) -> Race:
        gate = f"race-{uuid.uuid4().hex[:8]}"
        env = worker_env(redis_db.url)
        for n, plan in enumerate(plans):
            plan = {"url": redis_db.url, "gate": gate, "warmup": WARMUP_MODEL, "index": n, **plan}
            log = open(tmp_path / f"producer-{n}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-c", PRODUCER, json.dumps(plan)],
                                          env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
            log.close()
        return Race(redis_db, gate, procs, len(plans))

    yield start
    for p in procs:
        stop_process(p, grace_s=5)


@pytest.fixture()
def late_worker(redis_db: RedisDatabase, tmp_path: Path) -> Iterator[Any]:
    """Starts a worker of identity and sleep on the test's database when called (after a race);
    stops it by its PID at the end."""
    started: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        started.append(start_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu",
                                    "--models", "identity,sleep", "--hostname", "race@%h",
                                    **{FORWARD_MARKS_ENV: redis_db.url}))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def _queued(r: redis.Redis, queue: str) -> list[tuple[str, list[Any], str]]:
    """Each message on ``queue`` (oldest first): its request ID, its input's row, its identity."""
    out = []
    for raw in reversed(r.lrange(queue, 0, -1)):
        message = Message(raw, queue)
        parse_envelope(message)
        _, kwargs, _ = decode_body(message)
        request = decode_request(message.request_id, kwargs)
        out.append((message.request_id, request.inputs[0].value.reshape(-1).tolist(),
                    identity(queue, kwargs)))
    return out


def _claim(r: redis.Redis, rid: str) -> str:
    return (r.get(CLAIM_PREFIX + rid) or b"").decode()


def _print_counts(what: str, **counts: Any) -> None:
    print(f"\n{what}: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items()))


def test_8_processes_one_id_8_different_inputs_1_queued_1_answered_7_refused(
        start_race: Any, late_worker: Any, redis_db: RedisDatabase) -> None:
    # Given 8 producer processes, each sending per round the same request ID with inputs of its own
    r = redis_db.client
    rids = [f"race-a-{i}-{uuid.uuid4().hex[:8]}" for i in range(ROUNDS)]
    race = start_race([{"how": "client", "model": "identity", "input": "x", "datatype": "INT32",
                        "rounds": [[rid, [100 * p + i, p, i]] for i, rid in enumerate(rids)]}
                       for p in range(8)])
    # When all 8 publish at the same moment, round after round (no worker yet)
    t0 = time.monotonic()
    race.run_rounds(ROUNDS)
    sent = race.reports("sent")
    # Then per round exactly one is accepted, and the 7 others are refused naming the ID
    assert len(sent) == 8 * ROUNDS
    winners: dict[str, list[int]] = {}
    for rid in rids:
        outcomes = [s for s in sent if s["rid"] == rid]
        accepted = [s for s in outcomes if s["accepted"]]
        refused = [s for s in outcomes if not s["accepted"]]
        assert len(accepted) == 1 and len(refused) == 7, outcomes
        winners[rid] = accepted[0]["values"]
        for s in refused:
            assert s["error"] == "RequestIdReused", s
            assert s["message"].startswith(f"request {rid}: {REUSED} (their data"), s
    # and exactly one message per round is queued: the winner's, its identity the claim's
    queued = _queued(r, "infer.identity")
    assert sorted(q[0] for q in queued) == sorted(rids)
    for rid, row, ident in queued:
        assert row == winners[rid] and _claim(r, rid) == ident
    assert r.llen(f"infer.{WARMUP_MODEL}") == 8  # each producer's one warm-up, nothing more
    # When a worker comes
    late_worker()
    race.finish(ROUNDS)
    # Then each winner is answered with its own data, and nothing else ran
    done = race.reports("done")
    assert sorted(d["rid"] for d in done) == sorted(rids)
    for d in done:
        assert "error" not in d, d
        assert d["outputs"] == d["values"] == winners[d["rid"]]
        assert d["parameters"]["batch_size"] >= 1
    assert r.llen("infer.identity") == 0
    _print_counts("8 processes, one ID, 8 different inputs", rounds=ROUNDS, sent=len(sent),
                  accepted=ROUNDS, refused=len(sent) - ROUNDS, queued=len(queued), ran=len(queued),
                  answered=len(done), last_answer_s=f"{time.monotonic() - t0:.1f}",
                  publish_ms_max=f"{1000 * max(s['publish_s'] for s in sent):.0f}")


def test_8_processes_one_id_identical_inputs_1_queued_1_run_8_same_answers(
        start_race: Any, late_worker: Any, redis_db: RedisDatabase) -> None:
    # Given 8 producer processes sending per round the same request ID with the same input (the
    # sleep model, whose forward marks count its runs; each round's value its own)
    r = redis_db.client
    rids = [f"race-b-{i}-{uuid.uuid4().hex[:8]}" for i in range(ROUNDS)]
    values = {rid: (i + 1) / 64 for i, rid in enumerate(rids)}  # exact in FP32
    race = start_race([{"how": "client", "model": "sleep", "input": "input", "datatype": "FP32",
                        "output": "output", "rounds": [[rid, [values[rid]]] for rid in rids]}
                       for _ in range(8)])
    # When all 8 publish at the same moment, round after round (no worker yet)
    t0 = time.monotonic()
    race.run_rounds(ROUNDS)
    sent = race.reports("sent")
    # Then every one is accepted (the same request: one published, the others handed its future)
    assert len(sent) == 8 * ROUNDS and all(s["accepted"] for s in sent), sent
    # and one message per round is queued
    queued = _queued(r, "infer.sleep")
    assert sorted(q[0] for q in queued) == sorted(rids)
    assert all(row == [values[rid]] for rid, row, _ in queued)
    # When a worker comes
    marks = ForwardMarks(r, "sleep")
    late_worker()
    race.finish(8 * ROUNDS)
    # Then all 8 of each round get the same answer, from one run
    done = race.reports("done")
    assert len(done) == 8 * ROUNDS
    for rid in rids:
        answers = [d for d in done if d["rid"] == rid]
        assert len(answers) == 8 and all("error" not in d for d in answers), answers
        assert all(d["outputs"] == [values[rid]] for d in answers)
        parameters = [d["parameters"] for d in answers]
        assert all(p == parameters[0] for p in parameters), parameters  # worker, batch, timings
    runs = [b for b in marks.batches() if any(v in b for v in values.values())]
    rows = sorted(v for b in runs for v in b)
    assert rows == sorted(values.values()), runs  # each round's value on the device once
    _print_counts("8 processes, one ID, identical inputs", rounds=ROUNDS, sent=len(sent),
                  accepted=len(sent), refused=0, queued=len(queued), ran=len(rows),
                  answered=len(done), last_answer_s=f"{time.monotonic() - t0:.1f}")


#: How long a call or future waits for an answer here: the model sleeps under 0.3 s, so one that
#: waits this long is never answered (a refused duplicate that unhooked the accepted request's
#: waiters, as before c252080).
ANSWER_WITHIN_S = 15


def _post(gateway: GatewayProcess, model: str, doc: dict[str, Any], key: str
          ) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://{gateway.http_url}/v2/models/{model}/infer",
                                     data=json.dumps(doc).encode(),
                                     headers={"Idempotency-Key": key}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_WITHIN_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except TimeoutError:
        return 0, {"error": f"no answer in {ANSWER_WITHIN_S} s"}


def _stored(r: redis.Redis, rid: str) -> dict[str, Any]:
    """The final state stored for ``rid`` (empty while it has none: none, or STARTED)."""
    raw = r.get(f"celery-task-meta-{rid}")
    meta = kombu_json.loads(raw) if raw else {}  # kombu's reader: binary data as bytes
    return meta if meta.get("status") in ("SUCCESS", "FAILURE", "REVOKED") else {}


def test_gateway_16_concurrent_calls_one_key_two_bodies_8_answered_by_one_run_8_refused_422(
        redis_db: RedisDatabase, tmp_path: Path) -> None:
    # Given a worker of the sleep model (its forward marks count runs) and a gateway
    r = redis_db.client
    worker = launch_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                           "identity,sleep", "--hostname", "race@%h",
                           **{FORWARD_MARKS_ENV: redis_db.url})
    gateway = launch_gateway(redis_db.url, tmp_path / "gateway.log")
    ready_together([worker, gateway])  # started side by side; on a failure both stopped
    try:
        marks = ForwardMarks(r, "sleep")
        keys = [f"race-c-{i}-{uuid.uuid4().hex[:8]}" for i in range(ROUNDS)]
        bodies = {key: ((i + 1) / 64, (i + 17) / 64) for i, key in enumerate(keys)}  # exact FP32
        barrier = threading.Barrier(16)

        def call(n: int, key: str) -> tuple[float, int, dict[str, Any]]:
            value = bodies[key][n % 2]  # half the calls one body, half the other
            doc = {"id": f"call-{n}", "inputs": [{"name": "input", "datatype": "FP32",
                                                  "shape": [1, 1], "data": [value]}]}
            barrier.wait(30)
            return (value, *_post(gateway, "sleep", doc, key))

        t0 = time.monotonic()
        winners = []
        with ThreadPoolExecutor(16) as pool:
            for key in keys:
                # When 16 calls carry the same Idempotency-Key at the same moment, two bodies
                calls = list(pool.map(lambda n, key=key: call(n, key), range(16)))
                # Then one body's 8 calls are refused, 422 naming the key and what differs
                refused = [c for c in calls if c[1] == 422]
                assert len(refused) == 8, [(v, s, d) for v, s, d in calls]
                for _, _, answer in refused:
                    assert answer["error"].startswith(f"request {key}: {REUSED}"), answer
                value = set(bodies[key]) - {v for v, _, _ in refused}
                assert len(value) == 1, calls
                won = value.pop()
                winners.append(won)
                # and the other body ran: its result is stored under the key
                stored = wait_for(lambda key=key: _stored(r, key), 30, "the winner's result")
                assert stored["status"] == "SUCCESS"
                data = stored["result"]["outputs"][0]["data"]  # the gateway sends FP32 as bytes
                assert np.frombuffer(data, np.float32).tolist() == [won]
                # and its 8 calls are answered 200, identically (one run)
                ok = [c for c in calls if c[1] == 200]
                assert len(ok) == 8, (
                    f"key {key}: {len(ok)} of the 8 calls with the accepted body answered, "
                    f"{sum(1 for c in calls if c[1] == 0)} waited {ANSWER_WITHIN_S} s for "
                    f"nothing; the request ran (stored {stored['status']})")
                for v, _, answer in ok:
                    assert v == won and answer["outputs"][0]["data"] == [won]
                    assert answer["parameters"] == ok[0][2]["parameters"]  # worker, batch, times
                    assert answer["parameters"]["request_id"] == key
        last_answer_s = time.monotonic() - t0
        # and the device ran each winner once, and no loser
        losers = {v for pair in bodies.values() for v in pair} - set(winners)
        batches = marks.batches()
        rows = [v for b in batches for v in b]
        assert sorted(rows) == sorted(winners), batches
        assert not losers & set(rows)
        assert r.llen("infer.sleep") == 0
        _print_counts("gateway, 16 calls per key, two bodies", rounds=ROUNDS, sent=16 * ROUNDS,
                      answered_200=8 * ROUNDS, refused_422=8 * ROUNDS, ran=len(rows),
                      last_answer_s=f"{last_answer_s:.1f}")
    finally:
        stop_together([gateway, worker])


def test_8_threads_of_one_client_one_id_8_different_inputs_the_winner_is_answered(
        client: Any, redis_client: redis.Redis) -> None:
    # Given one Client (the session worker's) and 8 threads, each with inputs of its own
    rid = f"race-threads-{uuid.uuid4().hex[:8]}"
    barrier = threading.Barrier(8)

    def submit(p: int) -> tuple[int, Any, BaseException | None]:
        barrier.wait(30)
        future = client.submit("identity", {"x": np.array([[p, 1, 2]], np.int32)}, request_id=rid)
        try:
            future.sent(timeout_s=30)
        except Exception as exc:  # noqa: BLE001 - the refusal is what is counted
            return p, future, exc
        return p, future, None

    # When all 8 submit the same request ID at the same moment
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(submit, range(8)))
    # Then one is accepted and 7 are refused, naming the ID
    accepted = [(p, f) for p, f, e in outcomes if e is None]
    refused = [e for _, _, e in outcomes if e is not None]
    assert len(accepted) == 1 and len(refused) == 7, outcomes
    assert all(type(e).__name__ == "RequestIdReused" and str(e).startswith(f"request {rid}: "
                                                                           f"{REUSED}")
               for e in refused), refused
    # and the winner ran (its result stored with its own data) ...
    p, future = accepted[0]
    stored = wait_for(lambda: _stored(redis_client, rid), 30, "the winner's result")
    assert stored["status"] == "SUCCESS"
    # ... and its future ends with its own data
    answer = future.result(timeout=ANSWER_WITHIN_S)
    assert answer["x"].tolist() == [[p, 1, 2]]


def test_celery_send_task_and_client_race_one_task_id_1_accepted_1_refused(
        start_race: Any, late_worker: Any, redis_db: RedisDatabase) -> None:
    # Given a Celery producer (the app's send_task) and a Client, each sending per round the same
    # task ID with kwargs of its own: ROUNDS races, then one round each sends first (so that
    # both refusals are seen, whoever wins the races)
    r = redis_db.client
    rounds = ROUNDS + 2
    rids = [f"race-d-{i}-{uuid.uuid4().hex[:8]}" for i in range(rounds)]
    celery, client = 0, 1  # the producers' indexes
    race = start_race([{"how": how, "model": "identity", "input": "x", "datatype": "INT32",
                        "rounds": [[rid, [p, i, 7]] for i, rid in enumerate(rids)]}
                       for p, how in enumerate(("celery", "client"))])
    # When both publish at the same moment, round after round (no worker yet)
    t0 = time.monotonic()
    race.run_rounds(rounds, first={ROUNDS: celery, ROUNDS + 1: client})
    sent = race.reports("sent")
    # Then per round one is accepted and the other refused, naming the ID
    assert len(sent) == 2 * rounds
    won_by: dict[str, str] = {}
    for rid in rids:
        accepted = [s for s in sent if s["rid"] == rid and s["accepted"]]
        refused = [s for s in sent if s["rid"] == rid and not s["accepted"]]
        assert len(accepted) == 1 and len(refused) == 1, [s for s in sent if s["rid"] == rid]
        assert refused[0]["error"] == "RequestIdReused"
        assert refused[0]["message"].startswith(f"request {rid}: {REUSED}")
        won_by[rid] = accepted[0]["how"]
    # (the rounds that were no race went to the one that sent first: send_task refused the
    # Client's, and the Client's future the send_task's — send_task raised)
    assert won_by[rids[ROUNDS]] == "celery" and won_by[rids[ROUNDS + 1]] == "client"
    # and one message per round is queued, the winner's
    queued = _queued(r, "infer.identity")
    assert sorted(q[0] for q in queued) == sorted(rids)
    winners = {s["rid"]: s["values"] for s in sent if s["accepted"]}
    assert all(row == winners[rid] and _claim(r, rid) == ident for rid, row, ident in queued)
    # When a worker comes: each winner is answered with its own data
    late_worker()
    race.finish(rounds)
    done = race.reports("done")
    assert sorted(d["rid"] for d in done) == sorted(rids)
    assert all("error" not in d and d["outputs"] == winners[d["rid"]] for d in done), done
    raced = [won_by[rid] for rid in rids[:ROUNDS]]
    _print_counts("send_task against Client, one task ID", rounds=rounds, sent=len(sent),
                  accepted=rounds, refused=rounds, queued=len(queued), ran=len(queued),
                  answered=len(done), races_won_by_celery=raced.count("celery"),
                  races_won_by_client=raced.count("client"),
                  last_answer_s=f"{time.monotonic() - t0:.1f}")

