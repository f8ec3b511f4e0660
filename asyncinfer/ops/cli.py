"""The ``asyncinfer`` command.

commands: up (broker + a worker per device + a gateway; --detach), down, worker (one device
worker), gateway (KServe v2 HTTP/gRPC), infer, submit, result, cancel, purge, status, models,
stats, config, dead (dead letters), job (a file's rows through a model), bench.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncinfer.config.settings_checks import MODEL_CONTROL_MODES
from asyncinfer.ops.fleet_commands import (
    _models,
    cmd_cancel,
    cmd_config,
    cmd_gateway,
    cmd_model_control,
    cmd_models,
    cmd_purge,
    cmd_stats,
    cmd_status,
)
from asyncinfer.ops.job_commands import add_job_parser
from asyncinfer.ops.request_commands import cmd_infer, cmd_result, cmd_submit
from asyncinfer.ops.subcommands import SubcommandParser
from asyncinfer.ops.subcommands import positive_int as _positive

__all__ = ["main"]

def cmd_worker(args: argparse.Namespace) -> int:
    from asyncinfer.worker.launch import run_worker

    overrides: dict[str, Any] = {}
    if args.broker_url:
        overrides["broker_url"] = args.broker_url
    if args.metrics_port is not None:
        overrides["metrics_port"] = args.metrics_port
    if args.intra_op_threads is not None:
        overrides["intra_op_threads"] = args.intra_op_threads
    if args.model_dir:
        overrides["model_dir"] = _model_dir(args.model_dir)
    from asyncinfer.supervision.supervisor import CANNOT_START
    from asyncinfer.worker.launch import WorkerCannotStart

    try:
        return run_worker(args.device, _models(args.models or ""), concurrency=args.concurrency,
                          loglevel=args.loglevel, hostname=args.hostname, **overrides)
    except WorkerCannotStart as exc:
        print(f"asyncinfer worker: cannot start: {exc}", file=sys.stderr, flush=True)
        return CANNOT_START


def _model_dir(folder: str) -> str:
    """``--model-dir``, absolute (its workers may run elsewhere), checked to be a folder."""
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise SystemExit(f"asyncinfer: --model-dir {folder}: not a folder")
    return str(path)


def cmd_up(args: argparse.Namespace) -> int:
    from asyncinfer.ops.up import detect_devices, run_up

    if args.model_dir:  # its workers read it from their environment
        os.environ["ASYNCINFER_MODEL_DIR"] = _model_dir(args.model_dir)

    if args.detach:
        from asyncinfer.config.settings import Settings
        from asyncinfer.ops.detach import detach

        argv = [a for a in args.argv if a != "--detach"]
        devices = _models(args.devices or "") or detect_devices()
        return detach(argv, Settings.from_env(broker_url=args.broker_url, **_gateway_flags(args)),
                      len(devices))
    return run_up(broker_url=args.broker_url, devices=_models(args.devices or ""),
                  models=_models(args.models or ""), concurrency=args.concurrency,
                  **_gateway_flags(args))


def _gateway_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``up``'s gateway flags as settings overrides (None: the environment's or the default)."""
    return {"gateway": False if args.no_gateway else None, "http_port": args.http_port,
            "grpc_port": args.grpc_port, "gateway_metrics_port": args.gateway_metrics_port,
            "gateway_processes": args.gateway_processes,
            "model_control_mode": args.model_control_mode}


def cmd_down(args: argparse.Namespace) -> int:
    from asyncinfer.config.settings import Settings
    from asyncinfer.ops.detach import down

    return down(Settings.from_env(), purge=args.purge)


def cmd_dead(args: argparse.Namespace) -> int:
    from asyncinfer.ops.dead import run_dead

    return run_dead(args)


def _output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pretty", action="store_true", help="indented JSON instead of one line")
    p.add_argument("--output", choices=("json", "npy"), default="json",
                   help="json: the v2 response; npy: the outputs as an .npz archive on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``asyncinfer`` command."""
    parser = argparse.ArgumentParser(prog="asyncinfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-url", help="broker URL (default: ASYNCINFER_BROKER_URL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=SubcommandParser)

    p = sub.add_parser("up", help="broker (embedded Redis if none configured) + a worker per device")
    p.add_argument("--devices", help="comma-separated devices (default: every accelerator, else cpu)")
    p.add_argument("--models", help="comma-separated models (default: every registered model)")
    p.add_argument("--concurrency", type=int, help="task threads per worker")
    p.add_argument("--model-dir", metavar="DIR",
                   help="model folder: model files and Triton model repository folders "
                        "(default ASYNCINFER_MODEL_DIR)")
    p.add_argument("--detach", action="store_true",
                   help="run in the background; return once the workers (and gateway) are ready")
    p.add_argument("--no-gateway", action="store_true",
                   help="do not start the v2 gateway (default: ASYNCINFER_GATEWAY, on)")
    p.add_argument("--http-port", type=int, help="gateway's v2 REST port (default 8000; 0: off)")
    p.add_argument("--grpc-port", type=int, help="gateway's v2 gRPC port (default 8001; 0: off)")
    p.add_argument("--gateway-metrics-port", type=int,
                   help="gateway's Prometheus port (default 8002; 0: off)")
    p.add_argument("--gateway-processes", type=_positive, metavar="N",
                   help="serve the gateway from N processes sharing its ports (default "
                        "ASYNCINFER_GATEWAY_PROCESSES, else one)")
    p.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES,
                   help="whether the gateway serves repository load and unload (Triton's "
                        "--model-control-mode; default ASYNCINFER_MODEL_CONTROL_MODE, else none: "
                        "refused)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop the 'asyncinfer up' running in the background")
    p.add_argument("--purge", action="store_true",
                   help="then remove what it kept in its state folder: the embedded Redis' data "
                        "(its append-only file), log and password, up's log (refused while it "
                        "still runs)")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("worker", help="one device worker")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda:N, npu:N (default auto)")
    p.add_argument("--models", help="comma-separated models (default: every registered model)")
    p.add_argument("--concurrency", type=int, help="task threads (requests in flight)")
    p.add_argument("--model-dir", metavar="DIR",
                   help="model folder: model files and Triton model repository folders "
                        "(default ASYNCINFER_MODEL_DIR)")
    p.add_argument("--hostname", help="Celery node name (default DEVICE@host)")
    p.add_argument("--loglevel", help="log level (default ASYNCINFER_LOG_LEVEL or info)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on this port (default ASYNCINFER_METRICS_PORT; 0: off)")
    p.add_argument("--intra-op-threads", type=int, help="torch.set_num_threads (default "
                   "ASYNCINFER_INTRA_OP_THREADS; 0: on CPU, cores // instances)")
    p.set_defaults(func=cmd_worker)

    for name, func, text in (("infer", cmd_infer, "send one request and print the response "
                                                   "(--input-file: a request per line)"),
                             ("submit", cmd_submit, "send one request and print its request ID")):
        p = sub.add_parser(name, help=text)
        p.add_argument("model")
        if name == "infer":
            given = p.add_mutually_exclusive_group(required=True)
            given.add_argument("--input", help="JSON file, or - for stdin")
            given.add_argument("--input-file", metavar="FILE",
                               help="many requests: a JSON Lines file (or - for stdin), one "
                                    "request per line in any form --input takes; prints a JSON "
                                    "line per response, in input order (--timeout-s: each "
                                    "request's, from when it is sent)")
        else:
            p.add_argument("--input", required=True, help="JSON file, or - for stdin")
        p.add_argument("--datatype", help="v2 datatype for list inputs (default: the model's declared "
                       "one, from the model catalogue; else inferred)")
        p.add_argument("--serializer", choices=("json", "msgpack"),
                       help="message serializer (default: ASYNCINFER_TASK_SERIALIZER)")
        if name == "infer":
            p.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait")
            _output_options(p)
            p.add_argument("--stream", action="store_true",
                           help="print each part of the response as it arrives, one line per "
                                "part (a decoupled model's; any other's one answer is one part)")
            p.add_argument("--json", action="store_true",
                           help="with --stream: each part as one JSON object (request_id, "
                                "index, outputs)")
            p.add_argument("--window", type=_positive, metavar="N",
                           help="with --input-file: at most N requests unanswered at a time "
                                "(default: Client.map's window)")
            p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                           help="with --input-file: a progress bar on stderr (default: when "
                                "stderr is a terminal)")
        else:
            p.add_argument("--request-id", help="request ID (default: a new UUID)")
        p.set_defaults(func=func)

    p = sub.add_parser("result", help="wait for a request's response and print it")
    p.add_argument("request_id")
    p.add_argument("--model", help="the request's model: with ASYNCINFER_BROKER_ROUTES, its "
                   "result is on that model's broker (default: the default broker's)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait")
    _output_options(p)
    p.set_defaults(func=cmd_result)

    p = sub.add_parser("status", help="workers, devices, models, queue depths")
    p.add_argument("--timeout-s", type=float, default=1.0, help="how long workers may take to answer")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--watch", type=float, metavar="S", help="refresh every S seconds")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("models", help="the model catalogue: models, versions, ready, workers; "
                       "load or unload a model on running workers")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_models)
    control = p.add_subparsers(dest="action", metavar="{load,unload}")
    for action, text in (("load", "load a model on running workers and serve it there"),
                         ("unload", "unload a model from running workers (its waiting requests go "
                                    "to the other workers)")):
        q = control.add_parser(action, help=text)
        q.add_argument("model")
        q.add_argument("--version", default="", help="that version only (a load: registered as "
                       "MODEL@VERSION; an unload: the other versions serve on)")
        where = q.add_mutually_exclusive_group()
        where.add_argument("--workers", help="comma-separated worker names (default: every live "
                           "worker" + (")" if action == "load" else " hosting it)"))
        where.add_argument("--devices", help="comma-separated devices (cuda:0, cpu): the live "
                           "workers on those")
        q.add_argument("--timeout-s", type=float, default=60.0,
                       help="how long to wait for the workers' answers")
        if action == "load":
            q.add_argument("--factory", metavar="PKG.MOD:ATTR",
                           help="register it as MODEL@VERSION on each worker first (only from a "
                                "module ASYNCINFER_LOADABLE_FACTORIES allows)")
        if action == "unload":
            q.add_argument("--grace-s", type=float,
                           help="how long requests on a device may finish (default 10)")
        q.add_argument("--json", action="store_true", help="the outcome as one JSON object")
        q.set_defaults(func=cmd_model_control)

    p = sub.add_parser("stats", help="inference statistics (Triton's), summed over the fleet")
    p.add_argument("model", nargs="?", help="one model (default: every model)")
    p.add_argument("--workers", action="store_true", help="a line per worker and per device too")
    p.add_argument("--json", action="store_true", help="Triton's JSON form instead of the table")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("gateway", help="KServe v2 / Triton HTTP and gRPC in front of the fleet")
    p.add_argument("--host", help="address to listen on (default ASYNCINFER_GATEWAY_HOST or 127.0.0.1)")
    p.add_argument("--http-port", type=int,
                   help="v2 REST port (default ASYNCINFER_HTTP_PORT or 8000; 0: off)")
    p.add_argument("--grpc-port", type=int,
                   help="v2 gRPC port (default ASYNCINFER_GRPC_PORT or 8001; 0: off)")
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus port (default ASYNCINFER_GATEWAY_METRICS_PORT or 8002; 0: off)")
    p.add_argument("--processes", type=_positive, metavar="N",
                   help="serve from N supervised processes sharing the HTTP and gRPC ports "
                        "(SO_REUSEPORT; one that dies is restarted; process i serves metrics on "
                        "the metrics port + i). Default ASYNCINFER_GATEWAY_PROCESSES, else one "
                        "process, and a port another process holds is an error")
    p.add_argument("--allow-client-shm", action="store_true", default=None,
                   help="let same-host callers register system shared-memory regions for their "
                        "tensors (Triton's --allow-client-shm; default ASYNCINFER_ALLOW_CLIENT_SHM, "
                        "off)")
    p.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES,
                   help="explicit: serve repository load and unload (HTTP POST "
                        "/v2/repository/models/M/load|unload, gRPC RepositoryModelLoad|Unload); "
                        "none: refuse them, as Triton's --model-control-mode does (the index is "
                        "served either way). Default ASYNCINFER_MODEL_CONTROL_MODE, else none")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # --processes' children
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("cancel", help="revoke requests: one not yet on the device never runs")
    p.add_argument("request_ids", nargs="+", metavar="ID")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("purge", help="remove every request waiting on infer.MODEL (each REVOKED)")
    p.add_argument("model")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_purge)

    sub.add_parser("bench", help="asyncinfer vs plain Celery vs the in-process limit "
                                 "(asyncinfer bench --help)")

    p = sub.add_parser("config", help="the effective settings (or --table: every variable)")
    p.add_argument("--table", action="store_true", help="print the Markdown table of variables")
    p.set_defaults(func=cmd_config)

    add_job_parser(sub)

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
        from asyncinfer.ops.benchmark.run import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = argv
    if extra:  # said by the subcommand's parser, with its usage
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Python's SIG_IGN for SIGPIPE stays, for every command: a write to a socket whose peer died
    # (a Redis that failed over, a connection Redis closed) raises, to be retried or reported,
    # instead of killing the process without a word; `asyncinfer infer ... | head` ends quietly
    # below, where the write to the pipe raises.
    from asyncinfer.errors import AsyncInferError

    try:
        return int(args.func(args))
    except BrokenPipeError:  # our reader left (`| head`): what is left to print goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (AsyncInferError, TimeoutError, ValueError, OSError) as exc:
        print(f"asyncinfer {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
