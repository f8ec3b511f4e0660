"""``asyncinfer infer MODEL --input-file FILE``: a request per line of a JSON Lines file (or stdin),
sent through the client's window (client/jobs/windowed.py, what ``Client.map`` uses) and answered on
stdout in input order, one JSON line each, while later lines are still being read and sent.

The file is read as the window takes its lines, never whole: memory is bounded by the window, and
the first answers are printed while the rest of the file is still on its way (a pipe included).
A line that fails is one line on stderr naming its line number, and the others go on: one that is
not a request (not JSON, not a form ``--input`` takes) is said without anything sent for it; one
refused or failed by its model is said at its turn, with its request ID. A line's ``--timeout-s``
counts from when it was sent, so a fleet that does not answer times out each line once, not one
after another.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from tqdm import tqdm

from asyncinfer.client.jobs.windowed import Answering
from asyncinfer.ops.cli_io import (
    declared_inputs,
    failure_text,
    inputs_of,
    response_line,
    with_datatype_hint,
)

__all__ = ["cmd_infer_file", "infer_file"]


class _Line(Answering):
    """One line of the file on its way (client/jobs/windowed.py's ``Answering``): a timeout or a
    failure said as ``asyncinfer infer`` says them."""

    def said(self, exc: Exception) -> str:
        from asyncinfer.errors import RequestTimeout

        if isinstance(exc, RequestTimeout):
            return (f"RequestTimeout: request {self.future.id}: no result within "
                    f"{self.timeout_s:g} s of being sent; it may still finish (asyncinfer "
                    f"result {self.future.id})")
        return failure_text(self.future.id, exc)


def cmd_infer_file(args: argparse.Namespace) -> int:
    """``asyncinfer infer MODEL --input-file FILE``, its flags checked first."""
    from asyncinfer.ops.fleet_commands import _client

    for flag, given in (("--stream", args.stream), ("--pretty", args.pretty),
                        ("--output npy", args.output == "npy")):
        if given:
            raise SystemExit(f"asyncinfer infer: --input-file prints each response as one JSON "
                             f"line; {flag} is for one request (drop one of them)")
    with _client(args) as client:
        return infer_file(client, args)


def infer_file(client: Any, args: argparse.Namespace) -> int:
    """Send a request per non-blank line of ``args.input_file`` to ``args.model``; print each
    response (one JSON line) in input order, each failure (one line on stderr, its line number
    first); exit status 1 when any line failed."""
    from asyncinfer.client.jobs.windowed import DEFAULT_WINDOW, windowed

    with _opened(args.input_file) as stream:
        client.check_model(args.model)  # an unknown model: said once, not once per line
        send = _sender(client, args, declared_inputs(client, args.model))
        write, failed = _printer(), 0
        lines = windowed(send, _numbered(stream), window=args.window or DEFAULT_WINDOW,
                         timeout_s=None, forget=_forget, progress=args.progress,
                         description=args.model)
        for line in lines:
            if line.error is not None:
                failed += 1
                write(f"asyncinfer infer: line {line.number}: {line.error}", sys.stderr)
            else:
                write(response_line(line.response), sys.stdout)
    return 1 if failed else 0


def _sender(client: Any, args: argparse.Namespace,
            declared: dict[str, str]) -> Callable[[tuple[int, bytes]], _Line]:
    """What the window calls for each line: the line parsed (``--datatype`` and the catalogue's
    datatypes, as ``--input``), then sent; a line that is not a request, or that the client
    refuses at once, is a line with its error and nothing sent."""
    from asyncinfer.errors import InvalidRequest, ModelError

    def send(numbered: tuple[int, bytes]) -> _Line:
        number, text = numbered
        try:
            inputs, parameters = inputs_of(json.loads(text.rstrip(b"\r\n")), args.datatype, declared)
        except json.JSONDecodeError as exc:  # its position on the line, not JSON's "line 1"
            return _Line(number, error=f"not JSON ({exc.msg} at column {exc.colno}); nothing sent")
        except UnicodeDecodeError as exc:
            return _Line(number, error=f"not JSON ({exc}); nothing sent")
        except (ValueError, TypeError) as exc:  # not a form --input takes
            return _Line(number, error=f"not a request: {_said(exc, args.datatype)}; nothing sent")
        try:
            future = client.submit(args.model, inputs, parameters=parameters)
        except (InvalidRequest, ModelError) as exc:  # refused at once
            return _Line(number, error=f"{_said(exc, args.datatype)}; nothing sent")
        return _Line(number, future=future, timeout_s=args.timeout_s)

    return send


def _said(exc: Exception, datatype: str | None) -> str:
    """``exc`` as main says an error, with ``--datatype``'s hint where a datatype was refused."""
    hinted = with_datatype_hint(exc, datatype)
    return f"{type(hinted).__name__}: {hinted}"


def _numbered(stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """The file's non-blank lines with their numbers (from 1), read as the window takes them."""
    for number, text in enumerate(stream, 1):
        if text.strip():
            yield number, text


@contextmanager
def _opened(path: str) -> Iterator[IO[bytes]]:
    """The file (``-``: stdin) as bytes: each line is decoded on its own, so one that is not
    UTF-8 is that line's error, not the end of the run."""
    if path == "-":
        yield sys.stdin.buffer
        return
    with open(path, "rb") as stream:
        yield stream


def _forget(line: _Line) -> None:
    """A line unanswered when the run stops (an error said once, Ctrl-C): nothing to do, the
    client closes next and its result watcher with it."""


def _printer() -> Callable[[str, IO[str]], None]:
    """What prints a line (now: a reader of a pipe sees each answer as it comes). On a terminal,
    where the progress bar is drawn, around the bar; to a file or a pipe, plainly, so that a
    large run's answers do not redraw the bar once each."""
    on_terminal = sys.stdout.isatty()

    def write(text: str, stream: IO[str]) -> None:
        if stream is sys.stderr or on_terminal:
            tqdm.write(text, file=stream)
        else:
            stream.write(text + "\n")
        stream.flush()

    return write
