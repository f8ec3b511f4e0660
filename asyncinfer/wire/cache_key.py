"""The response cache's key of a request: a SHA-256 over a canonical encoding of everything that
decides its answer, and the weights that answered it.

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

The request gives the key's stem, ``asyncinfer:cache:entry:<name>:<sha256>``: ``<name>`` is the
model, or ``<model>@<version>`` when the request names a version (its *generation name*). What
answers it is not known yet (a request naming no version runs on the latest version of the worker
that takes it), so the stored entry adds the token of the weights that computed the answer
(:func:`entry_key`), and a look-up the token the generation name's requests are answered with now,
read from ``asyncinfer:cache:generation:<name>`` (:func:`generation_key`) by the publish script in
the same call: an answer of other weights is never found (broker/response_cache.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from asyncinfer.wire.input_parts import input_parts
from asyncinfer.wire.keys import RESPONSE_CACHE_PREFIX, response_cache_generation_key
from asyncinfer.wire.model_versions import PARAMETER, version_key

__all__ = ["BYPASS_PARAMETER", "FORMAT_VERSION", "cache_key", "bypassed", "generation_name",
           "generation_key", "entry_key", "split_entry"]

#: ``parameters={"response_cache": False}``: this request neither reads nor fills the cache.
BYPASS_PARAMETER = "response_cache"
#: Bumped when the encoding changes, so old entries are never read as new ones.
FORMAT_VERSION = 2

_ENTRY_PREFIX = RESPONSE_CACHE_PREFIX + "entry:"


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
        return _ENTRY_PREFIX + generation_name(model, kwargs) + ":" + _digest(model, kwargs)
    except (TypeError, ValueError, KeyError, orjson.JSONEncodeError):
        return None  # not keyable: no cache for it (the worker names what is wrong, if anything)


def generation_name(model: str, kwargs: Mapping[str, Any]) -> str:
    """``model``, or ``model@version`` when the request names a version in its parameters (read as
    the worker routes it: a non-empty string or an integer; anything else names none)."""
    params = kwargs.get("parameters")
    value = params.get(PARAMETER) if isinstance(params, Mapping) else None
    named = (str(value) if isinstance(value, (str, int)) and not isinstance(value, bool)
             else "")
    return version_key(model, named)


def generation_key(stem: str) -> str:
    """The generation key a key's ``stem`` (:func:`cache_key`) is looked up with; "" when the
    stem is no cache key."""
    if not stem.startswith(_ENTRY_PREFIX) or stem.count(":") < _ENTRY_PREFIX.count(":") + 1:
        return ""
    return response_cache_generation_key(stem[len(_ENTRY_PREFIX):].rpartition(":")[0])


def entry_key(stem: str, token: str) -> str:
    """The key the answer to ``stem``'s request computed by the weights ``token`` is stored
    under (what the publish script reads: the stem, ``:``, the generation's token)."""
    return stem + ":" + token


def split_entry(key: str) -> tuple[str, str]:
    """An entry key's generation key and weights token (:func:`entry_key` read back)."""
    stem, _, token = key.rpartition(":")
    return generation_key(stem), token


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
