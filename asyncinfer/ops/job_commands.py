"""``asyncinfer job run|status|cancel``: a file's rows through a model as a resumable job
(asyncinfer/client/jobs), its progress from any process, and its end."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from asyncinfer.ops.subcommands import positive_int

__all__ = ["add_job_parser", "cmd_job"]


def add_job_parser(sub: Any) -> None:
    """The ``job`` command's parser and its actions."""
    p = sub.add_parser("job", help="every row of a Parquet, JSON Lines or CSV file (or a folder of "
                       ".npy files) through a model, resumable: run, status, cancel")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("run", help="run a job, or resume one (--job-id of a job stopped "
                           "before its end)")
    q.add_argument("model")
    q.add_argument("--input", required=True, metavar="PATH",
                   help="the rows: .parquet, .jsonl, .csv, or a folder of .npy files (one row each)")
    q.add_argument("--output", required=True, metavar="PATH",
                   help="where the answers go, each row's input columns beside its outputs, "
                        "status and error, in input order: .parquet, .jsonl or .csv")
    q.add_argument("--job-id", help="the job's ID: a new job's (default: a new one, printed), or "
                   "the ID of a job to resume")
    q.add_argument("--map", action="append", default=[], metavar="INPUT=COLUMN",
                   help="feed model input INPUT from column COLUMN (default: the column of the "
                        "input's name; one input and one column go together whatever their names)")
    q.add_argument("--window", type=positive_int, metavar="N",
                   help="at most N rows unanswered at a time (default: Client.map's window)")
    q.add_argument("--timeout-s", type=float, metavar="S",
                   help="a row not answered S seconds after it was sent is written as failed "
                        "(default: each row waits for its answer)")
    q.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="a progress bar on stderr (default: when stderr is a terminal)")
    q.add_argument("--storage-options", metavar="JSON",
                   help="fsspec's options for an --input or --output URL, a JSON object (default: "
                        "ASYNCINFER_TENSOR_STORE_OPTIONS for a URL of the tensor store's kind)")
    q = actions.add_parser("status", help="a job's progress: rows done of all, failed, rows/s, "
                           "time left, state")
    q.add_argument("job_id", metavar="JOB")
    q.add_argument("--json", action="store_true", help="one JSON object instead of the line")
    q.add_argument("--watch", type=float, metavar="S", help="again every S seconds until it ends")
    q = actions.add_parser("cancel", help="stop a job: its producer stops at its next write, its "
                           "rows sent and not answered are revoked")
    q.add_argument("job_id", metavar="JOB")
    p.set_defaults(func=cmd_job)


def cmd_job(args: argparse.Namespace) -> int:
    from asyncinfer.client import Client

    with Client(broker_url=args.broker_url) as client:
        if args.action == "run":
            return _run(client, args)
        client.ping()
        redis = client.app_for("").backend.client
        if args.action == "status":
            return _status(redis, args)
        return _cancel(client, redis, args)


def _run(client: Any, args: argparse.Namespace) -> int:
    from asyncinfer.client.jobs.runner import JobCancelled, run_job
    from asyncinfer.client.jobs.windowed import DEFAULT_WINDOW

    mapping = {}
    for given in args.map:
        name, sep, column = given.partition("=")
        if not sep or not name or not column:
            raise SystemExit(f"asyncinfer job run: --map {given}: give INPUT=COLUMN")
        mapping[name] = column
    from asyncinfer.config.settings_checks import json_object

    options = json_object(args.storage_options, "--storage-options") if args.storage_options else None
    client.ping()
    try:
        result = run_job(client, args.model, args.input, args.output, job_id=args.job_id,
                         mapping=mapping, window=args.window or DEFAULT_WINDOW,
                         timeout_s=args.timeout_s, progress=args.progress,
                         announce=lambda text: print(text, file=sys.stderr, flush=True),
                         storage_options=options)
    except JobCancelled as exc:
        print(f"asyncinfer job run: {exc}", file=sys.stderr)
        return 1
    this_run = ""
    if result.run_rows:
        pace = result.run_rows / result.run_s if result.run_s > 0 else 0.0
        this_run = (f"; this run {result.run_rows:,} rows in {result.run_s:.1f} s "
                    f"({pace:,.1f} rows/s)")
    print(f"job {result.job_id}: completed, {result.rows:,} rows ({result.failed:,} failed) -> "
          f"{result.output}{this_run}", flush=True)
    return 1 if result.failed else 0


def _status(redis: Any, args: argparse.Namespace) -> int:
    from asyncinfer.client.jobs import record

    while True:
        try:
            found = record.read(redis, args.job_id)
        except KeyError as exc:
            print(f"asyncinfer job status: {exc.args[0]}", file=sys.stderr)
            return 1
        print(json.dumps(dataclasses.asdict(found), sort_keys=True) if args.json else found.line(),
              flush=True)
        if not args.watch or found.state != "running":
            return 0
        time.sleep(args.watch)


def _cancel(client: Any, redis: Any, args: argparse.Namespace) -> int:
    from asyncinfer.client.jobs import record
    from asyncinfer.client.jobs.runner import revoke_rows

    try:
        found = record.cancel(redis, args.job_id)
    except KeyError as exc:
        print(f"asyncinfer job cancel: {exc.args[0]}", file=sys.stderr)
        return 1
    revoked = revoke_rows(client.app_for(found.model), args.job_id, found.written, found.sent)
    print(f"job {args.job_id}: cancelled at {found.answered:,} of {found.rows:,} rows; "
          f"{revoked:,} rows sent and not written revoked", flush=True)
    return 0
