"""Triton's words for the errors its clients and tools match on.

Triton's own examples and tools look for Triton's texts in an error (``simple_http_infer_client.py``
checks that an unknown model's message *starts with* "Request for unknown model";
``grpc_explicit_int8_content_client.py`` looks for "failed to get model version from specified
version string '...'"). Each of our messages that answers such a case starts with Triton's words,
as Triton's core and server write them, and keeps our explanation after them: ``<Triton's words>
(request <id>): <why, and what to do>``. The sources of each text are named below (the
triton-inference-server ``core`` and ``server`` repositories).
"""

from __future__ import annotations

import re

__all__ = ["unknown_model", "bad_version", "is_version", "load_failed", "unload_failed",
           "contents_and_raw", "no_input_data", "leads"]

_NEGATIVE = re.compile(r"-[0-9]+")
#: How each text below begins.
_OPENINGS = ("Request for unknown model: ", "invalid model version specified ",
             "failed to get model version from specified version string ", "load failed for model ",
             "failed to unload ", "contents field must not be specified when using raw_input_contents",
             "unable to find data for input tensor ")


def leads(message: str) -> bool:
    """Whether ``message`` starts with Triton's words (then nothing goes before them)."""
    return message.startswith(_OPENINGS)


def unknown_model(model: str, version: str = "") -> str:
    """An unknown model, or an unknown version of a known one (core's
    ``ModelRepositoryManager::GetModel`` / ``FindModelIdentifier`` and ``ModelLifeCycle::GetModel``):
    ``Request for unknown model: 'm' is not found``, ``... 'm' version 3 is not found``."""
    which = f"'{model}' version {version}" if version else f"'{model}'"
    return f"Request for unknown model: {which} is not found"


def is_version(version: str) -> bool:
    """Whether ``version`` can name a version here: letters and digits (Triton's are integers
    above 0; ours are registered as ``m@v``, ``v`` any letters and digits)."""
    return version.isascii() and version.isalnum()


def bad_version(version: str) -> str:
    """A version string that names no version (server's ``GetModelVersionFromString``): a negative
    number is ``invalid model version specified '-1'``, anything else ``failed to get model
    version from specified version string '...'``."""
    if _NEGATIVE.fullmatch(version):
        return f"invalid model version specified '{version}'"
    return f"failed to get model version from specified version string '{version}'"


def load_failed(model: str) -> str:
    """A load that did not happen (core's ``ModelRepositoryManager::LoadUnloadModels``:
    ``load failed for model 'm': <why>``)."""
    return f"load failed for model '{model}'"


def unload_failed(model: str) -> str:
    """An unload that did not happen (core's ``LoadUnloadModel``: ``failed to unload 'm', ...``)."""
    return f"failed to unload '{model}'"


def contents_and_raw(name: str, model: str) -> str:
    """A gRPC input given both typed ``contents`` and ``raw_input_contents`` (server's
    ``grpc/infer_handler.cc``)."""
    return (f"contents field must not be specified when using raw_input_contents for '{name}' "
            f"for model '{model}'")


def no_input_data(name: str, model: str) -> str:
    """A gRPC input with no data: no contents and no ``raw_input_contents`` left for it (server's
    ``grpc/infer_handler.cc``)."""
    return f"unable to find data for input tensor '{name}' for model '{model}' in request"
