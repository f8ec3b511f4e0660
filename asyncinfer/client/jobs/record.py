"""A job's record in Redis (``asyncinfer:job:<id>``, a hash): what it runs (model, input, output,
mapping), how far it is (rows written, answered, failed, sent), its state, and who runs it; read by
``asyncinfer job status`` from any process while the job runs, and by a job started again under the
same ID to check it is the same job.

States: ``running`` (a producer is on it, or was until it died: ``seen_s`` says when it last
wrote), ``completed``, ``cancelled`` (``asyncinfer job cancel``: a producer that reads it stops),
``failed`` (its producer stopped on an error it could not go past, e.g. the broker gone).
The record expires ``RECORD_TTL_S`` after its last write.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from asyncinfer.wire.keys import JOB_PREFIX

__all__ = ["JobRecord", "JobStatus", "RECORD_TTL_S", "begin", "cancel", "finish", "progress", "read"]

#: How long a job's record outlives its last write (a week: a job left over a weekend resumes).
RECORD_TTL_S = 7 * 24 * 3600

_SAME_JOB = ("model", "input", "output", "mapping")


@dataclass(frozen=True)
class JobRecord:
    """What a job runs: kept with its progress, compared when it is started again."""

    job_id: str
    model: str
    input: str
    output: str
    mapping: dict[str, str]
    rows: int

    def fields(self) -> dict[str, str]:
        return {"model": self.model, "input": self.input, "output": self.output,
                "mapping": json.dumps(self.mapping, sort_keys=True), "rows": str(self.rows)}


@dataclass(frozen=True)
class JobStatus:
    """A job's progress as its record says, with its pace over its current run."""

    job_id: str
    state: str
    model: str
    input: str
    output: str
    rows: int
    written: int
    answered: int
    failed: int
    sent: int
    runs: int
    producer: str
    started_s: float
    seen_s: float
    rows_per_s: float | None
    eta_s: float | None
    error: str

    def line(self) -> str:
        """One line: ``job J: running, 1,024 / 20,000 rows (5.1 %), 0 failed, 512.0 rows/s, …``."""
        share = f" ({100.0 * self.answered / self.rows:.1f} %)" if self.rows else ""
        pace = "" if self.rows_per_s is None else f", {self.rows_per_s:,.1f} rows/s"
        eta = "" if self.eta_s is None or self.state != "running" else f", about {self.eta_s:,.0f} s left"
        seen = ""
        if self.state == "running":
            seen = f", last heard from {self.producer} {max(0.0, time.time() - self.seen_s):.0f} s ago"
        said = f": {self.error}" if self.error else ""
        return (f"job {self.job_id}: {self.state}{said}, {self.answered:,} / {self.rows:,} rows"
                f"{share}, {self.failed:,} failed{pace}{eta}{seen}; model {self.model}, "
                f"{self.input} -> {self.output}")


def _key(job_id: str) -> str:
    return JOB_PREFIX + job_id


def begin(redis: Any, record: JobRecord, written: int, failed_written: int) -> int:
    """Mark the job running from row ``written`` (the rows already in its output, ``failed_written``
    of them failed); returns which run this is (1: the first). ValueError when the ID is another
    job's or a cancelled one."""
    key = _key(record.job_id)
    had = {k.decode(): v.decode() for k, v in redis.hgetall(key).items()}
    if had:
        mine = record.fields()
        differ = [f"{name} {had.get(name)!r} (now {mine[name]!r})" for name in _SAME_JOB
                  if had.get(name) != mine[name]]
        if differ:
            raise ValueError(f"job {record.job_id} was started with another {', '.join(differ)}: "
                             f"start it again as it was, or give the new job another --job-id")
        if had.get("state") == "cancelled":
            raise ValueError(f"job {record.job_id} was cancelled; start it under another --job-id")
    now = time.time()
    runs = int(had.get("runs", "0")) + 1
    fields = {**record.fields(), "state": "running", "runs": str(runs), "written": str(written),
              # answered rows not written are answered again (from their stored results)
              "answered": str(written), "failed": str(failed_written),
              "failed_written": str(failed_written),
              "sent": str(max(written, int(had.get("sent", "0")))),
              "started_s": had.get("started_s", repr(now)), "run_started_s": repr(now),
              "run_from": str(written), "seen_s": repr(now), "error": "",
              "producer": f"{socket.gethostname()}:{os.getpid()}"}
    pipe = redis.pipeline()
    pipe.hset(key, mapping=fields)
    pipe.expire(key, RECORD_TTL_S)
    pipe.execute()
    return runs


def progress(redis: Any, job_id: str, *, written: int, failed_written: int, answered: int,
             failed: int, sent: int) -> str:
    """Write the job's counts; returns its state (``cancelled``: its producer stops)."""
    key = _key(job_id)
    pipe = redis.pipeline()
    pipe.hset(key, mapping={"written": str(written), "failed_written": str(failed_written),
                            "answered": str(answered), "failed": str(failed), "sent": str(sent),
                            "seen_s": repr(time.time())})
    pipe.expire(key, RECORD_TTL_S)
    pipe.hget(key, "state")
    state = pipe.execute()[-1]
    return state.decode() if state else "running"


def finish(redis: Any, job_id: str, state: str, error: str = "") -> None:
    """The job's end: ``completed``, ``failed`` (with why) or ``cancelled``."""
    key = _key(job_id)
    pipe = redis.pipeline()
    pipe.hset(key, mapping={"state": state, "error": error, "seen_s": repr(time.time())})
    pipe.expire(key, RECORD_TTL_S)
    pipe.execute()


def cancel(redis: Any, job_id: str) -> JobStatus:
    """Mark the job cancelled (its producer stops at its next write); returns its status before."""
    found = read(redis, job_id)
    redis.hset(_key(job_id), mapping={"state": "cancelled", "error": "cancelled"})
    return found


def read(redis: Any, job_id: str) -> JobStatus:
    """The job's status (KeyError naming the job when Redis has no record of it)."""
    had = {k.decode(): v.decode() for k, v in redis.hgetall(_key(job_id)).items()}
    if not had:
        raise KeyError(f"job {job_id}: no record of it (never started here, or its record expired "
                       f"{RECORD_TTL_S // 86400} days after it was last written)")
    rows, answered = int(had["rows"]), int(had.get("answered", "0"))
    run_s = float(had["seen_s"]) - float(had["run_started_s"])
    done_in_run = answered - int(had.get("run_from", "0"))
    rate = done_in_run / run_s if run_s > 0.5 and done_in_run > 0 else None
    return JobStatus(
        job_id=job_id, state=had.get("state", "running"), model=had["model"], input=had["input"],
        output=had["output"], rows=rows, written=int(had.get("written", "0")), answered=answered,
        failed=int(had.get("failed", "0")), sent=int(had.get("sent", "0")),
        runs=int(had.get("runs", "1")), producer=had.get("producer", ""),
        started_s=float(had["started_s"]), seen_s=float(had["seen_s"]), rows_per_s=rate,
        eta_s=None if rate is None else (rows - answered) / rate, error=had.get("error", ""))
