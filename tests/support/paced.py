"""kill -9 during a paced stream: two workers of the "gated" test model (models.py) share a stream
of requests while, every few seconds, one of them is killed with SIGKILL and replaced; what was
sent, answered, lost and run twice is counted (on a Redis broker, or any other: RabbitMQ)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import redis

from asyncinfer.client import Client
from tests.support.databases import gated_executions
from tests.support.processes import WorkerProcess, launch_worker, ready_together, stop_together
from tests.support.waiting import wait_for

__all__ = ["index_input", "kill_during_paced_stream", "started_by"]


def index_input(i: int) -> dict[str, np.ndarray]:
    """The "gated" model's input for request ``i``."""
    return {"index": np.array([[float(i)]], np.float64)}


def started_by(r: redis.Redis, request_ids: list[str]) -> dict[str, str]:
    """Request ID → the worker whose STARTED state is stored for it now (in the result backend
    ``r``), for those of ``request_ids`` that are STARTED."""
    if not request_ids:
        return {}
    metas = r.mget([f"celery-task-meta-{i}" for i in request_ids])
    started = {}
    for request_id, meta in zip(request_ids, metas, strict=True):
        if meta is None:
            continue
        stored = json.loads(meta)
        if stored.get("status") == "STARTED":
            started[request_id] = str((stored.get("result") or {}).get("hostname") or "")
    return started


def kill_during_paced_stream(url: str, r: redis.Redis, prefix: str, env: dict[str, str],
                             log_dir: os.PathLike[str], *, rate_per_s: float, duration_s: float,
                             kill_every_s: float, model: str = "gated", broker_url: str | None = None,
                             hold_s: float = 0.0) -> dict[str, float]:
    """Send ``rate_per_s`` requests of ``model`` (the "gated" test model under that name, ``env``
    registering it if need be) for ``duration_s`` while, every ``kill_every_s``, one of two workers
    is killed with SIGKILL and replaced.

    ``url`` is the Redis of the results (``r`` a client of it, ``prefix`` the model's, see
    databases.gated_broker), and the broker unless ``broker_url`` names another. With ``hold_s``,
    each kill comes while the victim holds requests: the model's gate is closed (a batch blocks on
    the device, the next ones wait behind it) ``hold_s`` before the kill and opened after it.

    Returns sent / answered (with its own value) / lost / ran_twice (the model ran it more than
    once) / kills; held (started by a victim when it was killed, answered by another worker);
    twice_unheld (ran twice without being held by a victim at a kill); to_last_answer_s (from
    the last request sent to the last answer); held_answered_s (the longest from a kill to the
    answer of a request its victim held).
    """
    client = (Client(broker_url=url) if broker_url is None
              else Client(broker_url=broker_url, result_backend=url))
    if broker_url is not None:
        env = {**env, "ASYNCINFER_BROKER_URL": broker_url, "ASYNCINFER_RESULT_BACKEND": url}
    workers: list[WorkerProcess] = []
    futures = []
    answered_at: dict[str, float] = {}
    done_sending = threading.Event()

    def stream() -> None:
        start = time.monotonic()
        for i in range(int(rate_per_s * duration_s)):
            pause = start + i / rate_per_s - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            future = client.submit(model, index_input(i))
            future.add_done_callback(lambda f: answered_at.setdefault(f.id, time.monotonic()))
            futures.append(future)
        done_sending.set()

    def launch(n: int) -> WorkerProcess:
        return launch_worker(url, Path(log_dir) / f"w{n}.log", "--device", "cpu", "--models",
                             model, "--hostname", f"{prefix}-{n}@%h", **env)

    kills = 0
    held_by_victims: dict[str, str] = {}  # request ID -> the victim that held it when killed
    killed_at: dict[str, float] = {}
    try:
        workers += ready_together([launch(0), launch(1)])
        sender = threading.Thread(target=stream)
        sender.start()
        # The replacement starts in the background (a worker takes seconds to start on a loaded
        # machine), so the kills keep their pace; a victim is always one that serves
        while not done_sending.wait(kill_every_s):
            victim = workers.pop(0).wait_ready()
            name = f"{prefix}-{_number(victim)}@"
            if hold_s:
                r.delete(f"{prefix}:blocked")
                r.set(f"{prefix}:gate", "closed")
                wait_for(lambda: r.exists(f"{prefix}:blocked"), 10, "a batch blocked at the gate",
                         poll_s=0.01)
                time.sleep(hold_s)
            waiting = [f.id for f in list(futures) if not f.done()]
            held_by_victims.update({i: name for i, who in started_by(r, waiting).items()
                                    if who.startswith(name)})
            victim.process.kill()
            killed_at[name] = time.monotonic()
            victim.process.wait()
            r.delete(f"{prefix}:gate")
            kills += 1
            workers.append(launch(len(workers) + kills))
        sender.join()
        sent_at = time.monotonic()
        deadline = sent_at + 60
        for f in futures:
            try:
                f.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - counted as lost below
                pass
        executions = gated_executions(r, prefix)
        answers = {f.id: f.result() for i, f in enumerate(futures)
                   if f.done() and not f.exception() and f.result()["output"].tolist() == [[i]]}
        twice = {futures[i].id for i, n in executions.items() if n > 1}
        held = {i for i, victim in held_by_victims.items() if i in answers
                and not str(answers[i].parameters.get("worker", "")).startswith(victim)}
        return {"sent": len(futures), "answered": len(answers), "lost": len(futures) - len(answers),
                "ran_twice": len(twice), "kills": kills, "held": len(held),
                "twice_unheld": len(twice - held_by_victims.keys()),
                "to_last_answer_s": round(max(answered_at.values(), default=sent_at) - sent_at, 2),
                "held_answered_s": round(max((answered_at[i] - killed_at[held_by_victims[i]]
                                              for i in held), default=0.0), 2)}
    finally:
        r.delete(f"{prefix}:gate")
        client.close()
        stop_together(workers)


def _number(worker: WorkerProcess) -> int:
    """The number ``launch`` gave ``worker`` (its log is ``w<n>.log``)."""
    return int(worker.log_path.stem[1:])
