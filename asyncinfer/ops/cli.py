"""The ``asyncinfer`` command: up, worker, infer, submit, result, status, config, dead."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _models(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def _read_inputs(path: str, datatype: str | None) -> tuple[Any, dict[str, Any]]:
    """Inputs and parameters from a JSON file or stdin.

    Accepts a v2 request (``{"inputs": [...], "parameters": {...}}``), a mapping of input
    name → (nested) list, or a bare (nested) list for the input named ``input``.
    """
    from asyncinfer.wire.payloads import to_input_payload

    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    doc = json.loads(text)
    if isinstance(doc, dict) and isinstance(doc.get("inputs"), list):
        return doc["inputs"], dict(doc.get("parameters") or {})
    if isinstance(doc, dict):
        return [to_input_payload(str(k), v, datatype=datatype) for k, v in doc.items()], {}
    return [to_input_payload("input", doc, datatype=datatype)], {}


def _client(args: argparse.Namespace) -> Any:
    from asyncinfer.client import Client

    return Client(broker_url=args.broker_url, serializer=getattr(args, "serializer", None))


def _print_response(response: Any) -> None:
    print(json.dumps(response.raw, indent=2, default=_bytes_as_list))


def _bytes_as_list(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def cmd_worker(args: argparse.Namespace) -> int:
    from asyncinfer.worker.launch import run_worker

    overrides: dict[str, Any] = {}
    if args.broker_url:
        overrides["broker_url"] = args.broker_url
    if args.metrics_port is not None:
        overrides["metrics_port"] = args.metrics_port
    run_worker(args.device, _models(args.models or ""), concurrency=args.concurrency,
               loglevel=args.loglevel, hostname=args.hostname, **overrides)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from asyncinfer.ops.up import run_up

    return run_up(broker_url=args.broker_url, devices=_models(args.devices or ""),
                  models=_models(args.models or ""), concurrency=args.concurrency)


def cmd_infer(args: argparse.Namespace) -> int:
    inputs, parameters = _read_inputs(args.input, args.datatype)
    with _client(args) as client:
        _print_response(client.infer(args.model, inputs, parameters=parameters,
                                     timeout_s=args.timeout_s))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    inputs, parameters = _read_inputs(args.input, args.datatype)
    with _client(args) as client:
        future = client.submit(args.model, inputs, parameters=parameters,
                               request_id=args.request_id)
        print(future.id)
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_response(client.result(args.request_id, timeout_s=args.timeout_s))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from asyncinfer.ops.status import cluster_status, format_status

    with _client(args) as client:
        print(format_status(cluster_status(client.app, timeout_s=args.timeout_s)))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from asyncinfer.config.settings import Settings, settings_table

    if args.table:
        print(settings_table())
        return 0
    from asyncinfer.connections import masked_url

    settings = Settings.from_env()
    print(f"broker_url      {masked_url(settings.resolved_broker_url())}")
    print(f"result_backend  {masked_url(settings.resolved_result_backend())}")
    for key, value in vars(settings).items():
        if key in ("broker_url", "result_backend"):
            continue
        if "password" in key and value:
            value = "**"
        print(f"{key:15} {value}")
    return 0


def cmd_dead(args: argparse.Namespace) -> int:
    import redis

    from asyncinfer.config.settings import Settings
    from asyncinfer.worker.dead_letters import DeadLetters

    if args.action == "requeue" and bool(args.request_ids) == bool(args.all):
        print("asyncinfer dead requeue: name request IDs or --all (not both)", file=sys.stderr)
        return 2
    dead = DeadLetters.from_settings(Settings.from_env(broker_url=args.broker_url), args.model)
    try:
        if args.action == "list":
            for _, e in dead.entries():
                reason = " ".join(e.reason.split())
                print(f"{e.request_id}  {e.failed_at}  attempts={e.attempts}  {e.reason_type}: {reason}")
        elif args.action == "show":
            entry = dead.find(args.request_id)
            if entry is None:
                print(f"asyncinfer dead show: request {args.request_id} is not among the dead letters "
                      f"of model {args.model!r}", file=sys.stderr)
                return 1
            print(json.dumps(dataclasses.asdict(entry), indent=2))
        elif args.action == "requeue":
            done = dead.requeue(None if args.all else args.request_ids)
            print(f"requeued {len(done.requeued)}")
            for request_id in done.not_found:
                print(f"request {request_id} is not among the dead letters of model {args.model!r}",
                      file=sys.stderr)
            for why in done.refused.values():
                print(why, file=sys.stderr)
            return 1 if done.not_found or done.refused else 0
        else:
            print(f"purged {dead.purge()}")
    except redis.RedisError as exc:
        print(f"asyncinfer dead {args.action}: the broker failed ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``asyncinfer`` command."""
    parser = argparse.ArgumentParser(prog="asyncinfer", description=__doc__)
    parser.add_argument("--broker-url", help="broker URL (default: ASYNCINFER_BROKER_URL)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="broker (embedded Redis if none configured) + a worker per device")
    p.add_argument("--devices", help="comma-separated devices (default: every accelerator, else cpu)")
    p.add_argument("--models", help="comma-separated models (default: every registered model)")
    p.add_argument("--concurrency", type=int, help="task threads per worker")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("worker", help="one device worker")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda:N, npu:N (default auto)")
    p.add_argument("--models", help="comma-separated models (default: every registered model)")
    p.add_argument("--concurrency", type=int, help="task threads (requests in flight)")
    p.add_argument("--hostname", help="Celery node name (default DEVICE@host)")
    p.add_argument("--loglevel", help="log level (default ASYNCINFER_LOG_LEVEL or info)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on this port (default ASYNCINFER_METRICS_PORT; 0: off)")
    p.set_defaults(func=cmd_worker)

    for name, func, text in (("infer", cmd_infer, "send one request and print the response"),
                             ("submit", cmd_submit, "send one request and print its request ID")):
        p = sub.add_parser(name, help=text)
        p.add_argument("model")
        p.add_argument("--input", required=True, help="JSON file, or - for stdin")
        p.add_argument("--datatype", help="v2 datatype for list inputs (default: inferred)")
        p.add_argument("--serializer", choices=("json", "msgpack"))
        if name == "infer":
            p.add_argument("--timeout-s", type=float, default=60.0)
        else:
            p.add_argument("--request-id", help="request ID (default: a new UUID)")
        p.set_defaults(func=func)

    p = sub.add_parser("result", help="wait for a request's response and print it")
    p.add_argument("request_id")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.set_defaults(func=cmd_result)

    p = sub.add_parser("status", help="workers, devices, models, queue depths")
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.set_defaults(func=cmd_status)

    sub.add_parser("bench", help="asyncinfer vs plain Celery vs the in-process limit "
                                 "(asyncinfer bench --help)")

    p = sub.add_parser("config", help="the effective settings (or --table: every variable)")
    p.add_argument("--table", action="store_true", help="print the Markdown table of variables")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("dead", help="dead letters: a model's requests that failed for good")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("list", help="one line per entry: request ID, when, attempts, reason")
    q.add_argument("model")
    q = actions.add_parser("show", help="one entry (its message, reason, attempts, worker) as JSON")
    q.add_argument("model")
    q.add_argument("request_id")
    q = actions.add_parser("requeue", help="send entries back to infer.MODEL (retries reset)")
    q.add_argument("model")
    q.add_argument("request_ids", nargs="*", metavar="ID")
    q.add_argument("--all", action="store_true", help="every entry of the model")
    q = actions.add_parser("purge", help="remove every entry of the model")
    q.add_argument("model")
    p.set_defaults(func=cmd_dead)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncinfer`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["worker"], ["up"]):
        import asyncinfer.engine  # noqa: F401 - sets OpenMP's wait policy before torch loads
    if argv[:1] == ["bench"]:  # its own parser: `asyncinfer bench --help`
        from asyncinfer.bench.run import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    from asyncinfer.errors import AsyncInferError

    try:
        return int(args.func(args))
    except (AsyncInferError, TimeoutError, ValueError, OSError) as exc:
        print(f"asyncinfer {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
