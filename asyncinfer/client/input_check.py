"""The client's check of a request's inputs against its model's declared ones, before it is sent.

A request that does not fit the signature its model announced in the catalogue (names, datatypes,
rank and row shape, the batch dimension: wire/signature.py) is refused at submit with
:class:`~asyncinfer.errors.InvalidRequest`, in the words its worker would have stored as its
FAILURE, and nothing is sent. The check errs on the side of sending: whatever it cannot judge as the
worker would goes out unchecked, and the worker checks it — no signature to check by
(:meth:`KnownModels.signature <asyncinfer.client.known_models.KnownModels.signature>`), a request
that names a version or a stage, inputs not in the v2 form, and, before a refusal, a request the
worker would refuse first for another reason (its wire form, or NaN in an earlier input).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.model_versions import PARAMETER
from asyncinfer.wire.payloads import decode_payload
from asyncinfer.wire.signature import Signature

__all__ = ["refuse_unfit"]

_SEQ = (list, tuple)


def refuse_unfit(signature: Signature | None, request_id: str, kwargs: Mapping[str, Any]) -> None:
    """Raise InvalidRequest when the ``asyncinfer.infer`` request ``kwargs`` (its ``inputs`` v2
    dicts, its ``parameters``) does not fit ``signature`` (None: nothing to check by)."""
    if signature is None:
        return
    parameters = kwargs.get("parameters") or {}
    if parameters and (type(parameters) is not dict or PARAMETER in parameters
                       or "stage" in parameters):
        return  # a version's inputs may be another's; a stage's are the forward's
    if signature.fits(kwargs.get("inputs")):  # the quick path of every good request
        return
    tensors = _tensors(kwargs.get("inputs"))
    if tensors is None:
        return
    refused = signature.first_refusal(request_id, tensors)
    if refused is None:
        return
    index, error = refused
    if _refused_first(request_id, kwargs, parameters, index):
        return
    raise error


def _tensors(items: Any) -> list[tuple[str, str, Sequence[int]]] | None:
    """Each input's (name, datatype, shape); None unless each is a v2 dict of a distinct name."""
    if not isinstance(items, _SEQ) or not items:
        return None
    tensors: list[tuple[str, str, Sequence[int]]] = []
    for item in items:
        if not isinstance(item, Mapping):
            return None
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if (not isinstance(name, str) or not name or not isinstance(datatype, str)
                or not isinstance(shape, _SEQ) or not all(type(d) is int for d in shape)):
            return None
        tensors.append((name, datatype, tuple(shape)))
    if len({t[0] for t in tensors}) != len(tensors):
        return None
    return tensors


def _refused_first(request_id: str, kwargs: Mapping[str, Any], parameters: Mapping[str, Any],
                   index: int) -> bool:
    """Whether the worker would refuse the request before it reaches the input at ``index``
    (-1: the missing inputs) for another reason, in other words: its wire form (every input is
    decoded first: wire/protocol.py), or a NaN or infinity in an input before it (a model may
    refuse those; the catalogue does not say which do)."""
    if "binary_data_output" in parameters and not isinstance(parameters["binary_data_output"], bool):
        return True
    for position, item in enumerate(kwargs["inputs"]):
        try:
            _, _, value, _ = decode_payload(f"request {request_id}: input '{item['name']}'", item)
        except InvalidRequest:
            return True
        if position < index and value.dtype.kind in "fc" and not np.isfinite(value).all():
            return True
    return False
