"""What a caller-chosen request ID stands for: one request, with one model, version, inputs and
parameters — never another's answer.

A request sent with an ID its caller chose (the ``Client``'s ``request_id``, a Celery ``task_id``,
the gateway's ``Idempotency-Key``) claims ``asyncinfer:request:<id>`` in the same script that
pushes it (broker/publisher.py). The claim holds the request's *identity*: its queue, then a
fingerprint of what decides its answer, each part apart so that a refusal can say which differs::

    <queue> US 1 US <model_version> US <inputs digest> US <parameters digest>

(US: the ASCII unit separator, 0x1f; ``1``: this form's version). The digests are BLAKE2b (8
bytes, hex) over the inputs' parts (wire/input_parts.py: names, datatypes, shapes, how the data
travels, the data as sent) and over the parameters other than ``model_version`` (sorted JSON).

The same ID sent again with the same identity is the same request: nothing is pushed, the caller
gets the first request's answer (one run, one answer). With another identity it is refused at
once, naming the ID and what differs (:func:`reused_message`). A claim that holds only a queue (a
generated ID's trace, or a request whose parts cannot be encoded) is judged by its queue alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from asyncinfer.wire.envelope import printable
from asyncinfer.wire.input_parts import input_parts

__all__ = ["SEP", "identity", "queue_of", "same_request", "differences", "reused_message"]

#: Between the parts of a claim (the ASCII unit separator: never in a queue's name).
SEP = "\x1f"
#: The claim's form; bumped when the digests change, so an old claim is never misread.
FORM = "1"
#: The parameter that names the version a request wants (model_versions.PARAMETER).
_VERSION = "model_version"


def identity(queue: str, kwargs: Mapping[str, Any]) -> str:
    """The claim value of the v2 request ``kwargs`` sent to ``queue``: its queue and fingerprint;
    the queue alone when its parts cannot be encoded (a value JSON cannot hold)."""
    try:
        params = kwargs.get("parameters") or {}
        if not isinstance(params, Mapping):
            raise TypeError("parameters")
        described, datas = input_parts(kwargs["inputs"])
        inputs = hashlib.blake2b(orjson.dumps(described), digest_size=8)
        for raw in datas:
            inputs.update(len(raw).to_bytes(8, "little"))
            inputs.update(raw)
        rest = {str(k): v for k, v in params.items() if k != _VERSION}
        parameters = hashlib.blake2b(orjson.dumps(rest, option=orjson.OPT_SORT_KEYS),
                                     digest_size=8)
        version = params.get(_VERSION)
    except (TypeError, ValueError, KeyError, orjson.JSONEncodeError):
        return queue
    return SEP.join((queue, FORM, "" if version is None else str(version),
                     inputs.hexdigest(), parameters.hexdigest()))


def queue_of(claim: str) -> str:
    """The queue a claim names."""
    return claim.split(SEP, 1)[0]


def same_request(mine: str, stored: str) -> bool:
    """Whether the claim ``stored`` is that of the request whose identity is ``mine`` (or too old
    or too bare to tell: the publish script's rule, broker/publisher.py)."""
    return stored in ("1", mine) or not differences(mine, stored)


def differences(mine: str, stored: str) -> list[str]:
    """What differs between two claims of one ID, in words (``stored`` the first request's;
    empty: the same request, or a claim too old or too bare to tell)."""
    ours, theirs = mine.split(SEP), stored.split(SEP)
    if ours[0] != theirs[0]:
        return [f"model (first sent to queue {theirs[0]}, now to {ours[0]})"]
    if len(ours) != 5 or len(theirs) != 5 or ours[1] != theirs[1]:
        return []
    found = []
    if ours[2] != theirs[2]:
        found.append(f"model version (first {_version(theirs[2])}, now {_version(ours[2])})")
    if ours[3] != theirs[3]:
        found.append("inputs (their data, datatypes, shapes, names or encoding)")
    if ours[4] != theirs[4]:
        found.append("parameters")
    return found


def reused_message(request_id: str, mine: str, stored: str) -> str:
    """Why a request whose ID was sent before with another identity is refused."""
    what = differences(mine, stored) or ["request"]
    listed = what[0] if len(what) == 1 else ", ".join(what[:-1]) + " and " + what[-1]
    return (f"request {printable(request_id)}: this request ID was already sent with a different "
            f"{listed}; a request ID names one request, and its answer would be the first "
            f"one's (send a new request with a new ID, or with none: one is generated)")


def _version(version: str) -> str:
    return f"version {version}" if version else "the latest version"
