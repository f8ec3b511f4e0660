"""What the ``asyncinfer`` command reads and prints for a request: its inputs (a file or stdin,
with the datatypes the model catalogue declares), its response (JSON or ``.npz``), the line a
failed request gets, and the hint a refused datatype gets."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

__all__ = ["read_inputs", "inputs_of", "declared_inputs", "print_response", "response_line",
           "print_part", "failure_line", "failure_text", "with_datatype_hint"]

#: Celery's reasons for a revoke (the whole message of the ``TaskRevokedError`` it stores), in words.
_REVOKED = {"revoked": "revoked before a worker ran it",
            "expired": "expired before a worker ran it (its expires, or the deadline of its timeout)",
            "terminated": "revoked and ended while it ran"}

#: A model's refusal of a datatype (models/base.py), which ``--datatype`` answers for list inputs.
_DATATYPE_REFUSED = re.compile(r"datatype (\w+) is not accepted \(accepted: (\w+)")


def read_inputs(path: str, datatype: str | None,
                declared: dict[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
    """Inputs and parameters from a JSON file or stdin (``-``): :func:`inputs_of` its document."""
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    return inputs_of(json.loads(text), datatype, declared)


def inputs_of(doc: Any, datatype: str | None,
              declared: dict[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
    """Inputs and parameters from one request's JSON document (a file of ``--input``, a line of
    ``--input-file``).

    Accepts a v2 request (``{"inputs": [...], "parameters": {...}}``), a mapping of input
    name → (nested) list, or a bare (nested) list: the model's one declared input, else ``input``.
    ``declared`` (input name → datatype, from the model catalogue) gives list inputs their
    datatype when ``--datatype`` does not.
    """
    from asyncinfer.wire.payloads import to_input_payload

    declared = declared or {}
    if isinstance(doc, dict) and isinstance(doc.get("inputs"), list):
        return doc["inputs"], dict(doc.get("parameters") or {})
    if not isinstance(doc, dict):
        doc = {next(iter(declared)) if len(declared) == 1 else "input": doc}
    return [to_input_payload(str(k), v, datatype=datatype or declared.get(str(k)))
            for k, v in doc.items()], {}


def declared_inputs(client: Any, model: str) -> dict[str, str]:
    """Input name → datatype of ``model`` as its workers announced it (empty when unknown)."""
    from asyncinfer.client.jobs.row_inputs import declared

    return declared(client, model, "inputs")


def print_response(response: Any, args: argparse.Namespace) -> None:
    """The response as one JSON line (``--pretty``: indented), or ``--output npy``: its outputs as
    an ``.npz`` archive of numpy arrays on stdout (``np.load`` reads it)."""
    if getattr(args, "output", "json") == "npy":
        import numpy as np

        np.savez(sys.stdout.buffer, **{name: _without_pickle(name, response[name])
                                       for name in response.outputs})
        sys.stdout.buffer.flush()
        return
    if getattr(args, "pretty", False):
        print(json.dumps(response.raw, indent=2, default=_bytes_as_list))
    else:
        print(response_line(response))


def response_line(response: Any) -> str:
    """The v2 response as one JSON line (BYTES data as lists of byte values)."""
    return json.dumps(response.raw, separators=(",", ":"), default=_bytes_as_list)


def print_part(part: Any, args: argparse.Namespace) -> None:
    """One part of a streamed response on one line, as soon as it arrives: ``<index>
    <name>=<values as JSON> ...`` (BYTES as text where it is UTF-8), or ``--json``: the part as
    one JSON object (``request_id``, ``index``, ``outputs``: its v2 tensors)."""
    if getattr(args, "json", False):
        print(json.dumps(part.as_json(), separators=(",", ":"), default=_bytes_as_list), flush=True)
        return
    values = " ".join(f"{name}=" + json.dumps(_as_text(part[name].tolist()), ensure_ascii=False,
                                              default=_bytes_as_list) for name in part.outputs)
    print(f"{part.index} {values}", flush=True)


def _as_text(value: Any) -> Any:
    """``value`` (nested lists) with UTF-8 bytes as text."""
    if isinstance(value, list):
        return [_as_text(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            return value
    return value


def _without_pickle(name: str, value: Any) -> Any:
    """``value`` as an array ``np.load`` reads without pickle: a BYTES output (an object array,
    which ``np.savez`` would pickle) becomes fixed-width bytes (``S``). ValueError when that would
    change an element: numpy's ``S`` drops trailing NUL bytes."""
    import numpy as np

    array = np.asarray(value)
    if array.dtype != object:
        return array
    items = [x.encode() if isinstance(x, str) else x for x in array.reshape(-1).tolist()]
    if not all(isinstance(x, (bytes, bytearray)) and not x.endswith(b"\0") for x in items):
        raise ValueError(f"output '{name}': an element that is not text, or ends in a NUL byte, has "
                         f"no .npy form without pickle (never written); use --output json")
    return np.array(items, dtype=bytes).reshape(array.shape)


def _bytes_as_list(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


#: A program's own words for two dtypes that did not match (a model file declares no inputs, so
#: a list sent as another datatype than its weights' fails inside it): torch's names.
_DTYPES_MISMATCHED = re.compile(r"(?:got|type) (\w+) (?:and|but found) (\w+)")
_TORCH_DATATYPES = {"Long": "INT64", "Int": "INT32", "Short": "INT16", "Char": "INT8",
                    "Byte": "UINT8", "Bool": "BOOL", "Float": "FP32", "Double": "FP64",
                    "Half": "FP16", "BFloat16": "BF16"}
#: What a list in a JSON file is sent as without ``--datatype`` (read_inputs).
_LIST_DATATYPES = ("INT64", "FP32")


def with_datatype_hint(exc: Exception, given: str | None) -> Exception:
    """``exc``, plus ``--datatype X`` when the model refused the datatype inferred from a list:
    a declared input's refusal, or a model file's program that met two dtypes it cannot mix."""
    if given:
        return exc
    refused = _DATATYPE_REFUSED.search(str(exc))
    if refused is not None:
        sent, wanted = refused.group(1), refused.group(2)
    else:
        mismatched = _DTYPES_MISMATCHED.search(str(exc))
        pair = [_TORCH_DATATYPES.get(name) for name in mismatched.groups()] if mismatched else []
        # the list's: the one a list is sent as (a program's weights are not integers)
        sent_ones = [d for d in _LIST_DATATYPES if d in pair]
        if len(pair) != 2 or None in pair or pair[0] == pair[1] or not sent_ones:
            return exc
        sent = sent_ones[0]
        wanted = str(pair[1] if pair[0] == sent else pair[0])
    return type(exc)(f"{exc}; the list was sent as {sent}: pass --datatype {wanted}")


def failure_line(command: str, request_id: str, exc: BaseException) -> str:
    """The one line ``asyncinfer <command>`` prints when request ``request_id`` failed with
    ``exc``: ``asyncinfer <command>: <type>: request <id>: <what happened>``, the shape of the
    command's other errors.

    ``exc`` is whatever the request's stored failure decodes to, not only asyncinfer's errors
    (whose messages name the request already): Celery's time limits, whose message is the bare
    limit when Celery's pool stored them (``TimeLimitExceeded(2.0,)``); a worker process that died;
    a revoke (``TaskRevokedError('expired')``); a type this process cannot import, which Celery
    rebuilds by its name; an exception raised without a message. The client's
    ``RequestRevoked`` is said as the ``TaskRevokedError`` that was stored (its cause).
    """
    return f"asyncinfer {command}: {failure_text(request_id, exc)}"


def failure_text(request_id: str, exc: BaseException) -> str:
    """What :func:`failure_line` says after the command's name: ``<type>: request <id>: <what
    happened>`` (``infer --input-file`` puts the line's number before it)."""
    from celery.exceptions import TaskRevokedError

    from asyncinfer.errors import RequestRevoked

    if isinstance(exc, RequestRevoked) and isinstance(exc.__cause__, TaskRevokedError):
        exc = exc.__cause__
    text = _what_happened(exc)
    if not (text.startswith(f"request {request_id}:") or text.startswith(f"request {request_id} ")):
        text = f"request {request_id}: {text}"
    return f"{type(exc).__name__}: {text}"


def _what_happened(exc: BaseException) -> str:
    from celery.exceptions import TaskRevokedError, WorkerLostError

    from asyncinfer.client.responses import time_limit_words

    limit = time_limit_words(exc)  # Celery's time limits: str() is their repr
    if limit is not None:
        return limit
    text = str(exc).strip()
    if isinstance(exc, WorkerLostError):
        return f"its worker process died while it ran ({text})" if text else \
            "its worker process died while it ran"
    if isinstance(exc, TaskRevokedError):
        return _REVOKED.get(text, text or "revoked")
    return text or "(no message)"
