"""The response cache's key of a request: a SHA-256 over a canonical encoding of everything that
decides its answer.

The client computes it from the request it is about to publish, the worker from the keyword
arguments it took: both read the same v2 kwargs (``model``, ``inputs``, ``parameters``), so both get
the same key. What goes in, in this order:

- a header, as JSON with sorted keys: the key format's version, the model, ``model_version``
  (when the request names one), each input's name, datatype, shape and how its data travels
  (``"bytes"``: raw little-endian bytes; ``"json"``: a list), and the request's ``parameters``
  without ``response_cache`` (the bypass flag itself);
- then per input, in request order: the data's length in bytes (8 bytes, little-endian) and the
  data: the raw bytes as sent, or the list as compact JSON (orjson: floats in their shortest exact
  form, so a value reads back as the float it was).

So a one-bit change of any input's bytes, a datatype, a shape, a name, the order of the inputs or
a parameter (``binary_data_output`` included, which changes the answer's encoding) gives another
key. The same numbers sent once as a list and once as bytes give two keys (their answers are
encoded differently). A request whose parts cannot be encoded so (a value JSON cannot hold) has no
key: it is neither looked up nor stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from asyncinfer.wire.input_parts import input_parts
from asyncinfer.wire.keys import RESPONSE_CACHE_PREFIX

__all__ = ["BYPASS_PARAMETER", "FORMAT_VERSION", "cache_key", "bypassed"]

#: ``parameters={"response_cache": False}``: this request neither reads nor fills the cache.
BYPASS_PARAMETER = "response_cache"
#: Bumped when the encoding changes, so old entries are never read as new ones.
FORMAT_VERSION = 1


def bypassed(kwargs: Mapping[str, Any]) -> bool:
    """Whether the request asks not to use the cache (``parameters.response_cache`` false)."""
    params = kwargs.get("parameters")
    return isinstance(params, Mapping) and params.get(BYPASS_PARAMETER, True) is False


def cache_key(model: str, kwargs: Mapping[str, Any]) -> str | None:
    """The Redis key of the cached answer to the v2 request ``kwargs`` for ``model``; None when
    the request bypasses the cache or cannot be keyed."""
    if bypassed(kwargs):
        return None
    try:
        return RESPONSE_CACHE_PREFIX + "entry:" + model + ":" + _digest(model, kwargs)
    except (TypeError, ValueError, KeyError, orjson.JSONEncodeError):
        return None  # not keyable: no cache for it (the worker names what is wrong, if anything)


def _digest(model: str, kwargs: Mapping[str, Any]) -> str:
    params = kwargs.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise TypeError("parameters")
    described, datas = input_parts(kwargs["inputs"])
    header = {"v": FORMAT_VERSION, "model": model, "version": kwargs.get("model_version"),
              "inputs": described,
              "parameters": {k: v for k, v in params.items() if k != BYPASS_PARAMETER}}
    digest = hashlib.sha256(orjson.dumps(header, option=orjson.OPT_SORT_KEYS))
    for raw in datas:
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.hexdigest()
