"""The commands about one request (or one per line): ``infer``, ``submit``, ``result`` — what
they send, how they wait, and the one line a request that failed is said in."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from asyncinfer.ops.cli_io import (
    declared_inputs,
    failure_line,
    print_part,
    print_response,
    read_inputs,
    with_datatype_hint,
)
from asyncinfer.ops.fleet_commands import _client

__all__ = ["cmd_infer", "cmd_submit", "cmd_result"]


def cmd_infer(args: argparse.Namespace) -> int:
    from asyncinfer.errors import InvalidRequest, ModelError

    if args.stream and args.output != "json":
        raise SystemExit("asyncinfer infer: --stream prints each part as it arrives; "
                         "--output npy is for one response (drop one of them)")
    if args.json and not args.stream:
        raise SystemExit("asyncinfer infer: --json is for --stream (one JSON object per part); "
                         "a whole response is printed as JSON already")
    if args.input_file is None and (args.window is not None or args.progress is not None):
        raise SystemExit("asyncinfer infer: --window and --progress are for --input-file "
                         "(a request per line); --input is one request")
    if args.input_file is not None:  # a request per line
        from asyncinfer.ops.infer_file import cmd_infer_file

        return cmd_infer_file(args)
    with _client(args) as client:
        inputs, parameters = read_inputs(args.input, args.datatype,
                                          declared_inputs(client, args.model))
        try:
            if args.stream:
                return _infer_stream(client, args, inputs, parameters)
            future = client.submit(args.model, inputs, parameters=parameters)
            response = _outcome(args, future.id, lambda: future.result(timeout=args.timeout_s))
        except (InvalidRequest, ModelError) as exc:  # a list sent as another datatype, hinted
            raise with_datatype_hint(exc, args.datatype) from None
        if response is None:
            return 1
        print_response(response, args)
    return 0


def _infer_stream(client: Any, args: argparse.Namespace, inputs: Any, parameters: Any) -> int:
    """``infer --stream``: each part on its own line as it arrives; an interruption (its worker
    died, the request runs again) on stderr; a request that failed, the line ``infer`` and
    ``result`` print (:func:`_outcome`), exit status 1."""
    def interrupted(interruption: Any) -> None:
        print(f"asyncinfer infer: request {interruption.request_id}: interrupted after part "
              f"{interruption.after_part} ({interruption.reason}); waiting for it to run again",
              file=sys.stderr, flush=True)

    def print_parts() -> bool:
        for part in parts:
            print_part(part, args)
        return True

    with client.stream(args.model, inputs, parameters=parameters, timeout_s=args.timeout_s,
                       on_interrupted=interrupted) as parts:
        return 0 if _outcome(args, parts.request_id, print_parts) else 1


def cmd_submit(args: argparse.Namespace) -> int:
    with _client(args) as client:
        inputs, parameters = read_inputs(args.input, args.datatype,
                                          declared_inputs(client, args.model))
        future = client.submit(args.model, inputs, parameters=parameters,
                               request_id=args.request_id).sent()  # queued, or say why not
        print(future.id)
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = _outcome(args, args.request_id, lambda: client.result(
            args.request_id, timeout_s=args.timeout_s, model=args.model))
        if response is None:
            return 1
        print_response(response, args)
    return 0


def _outcome(args: argparse.Namespace, request_id: str, wait: Callable[[], Any]) -> Any:
    """``wait()``'s response, or None once a request that failed is said on one line (stderr).

    asyncinfer's own errors go on to :func:`main`, which says them (they name the request);
    anything else is what the request's stored failure decoded to (Celery's time limits and
    revokes, a worker that died, a type Celery rebuilt by name), which would otherwise end the
    command with a traceback. A revoke (the client's RequestRevoked, a TaskRevokedError too) is
    said as what was stored."""
    from celery.exceptions import TaskRevokedError

    from asyncinfer.errors import AsyncInferError

    try:
        return wait()
    except Exception as exc:  # noqa: BLE001 - said on one line, exit status 1
        if isinstance(exc, AsyncInferError) and not isinstance(exc, TaskRevokedError):
            raise
        print(failure_line(args.command, request_id, exc), file=sys.stderr)
        return None
