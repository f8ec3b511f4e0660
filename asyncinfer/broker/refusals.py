"""Redis' refusals: error replies that say "not now" about the server, not "never" about the command.

A full disk (``MISCONF``), ``maxmemory`` reached under ``noeviction`` (``OOM``), a replica or a
demoted master (``READONLY``), a script cache that was flushed (``NOSCRIPT``), a long script
(``BUSY``), a data set still loading (``LOADING``), a replica that lost its master
(``MASTERDOWN``): the same command succeeds once the server is itself again. Every consumer rides
these out with backoff, and a producer is told which one it met, in Redis' own words.

redis-py raises some of them as classes of their own (it strips the code from the message) and the
rest, ``MISCONF`` and ``BUSY`` among them, as a plain ``ResponseError``; inside a script or a
transaction the reply is wrapped ("Error running script ... -MISCONF ...", "Command # 1 ... of
pipeline caused error: MISCONF ..."). :func:`refusal_code` finds the code in each form, and
:func:`refusing_parser` makes a connection raise :class:`RedisRefusal` for the plain ones, so that
kombu and Celery can tell them from a real error by class.
"""

from __future__ import annotations

import re
from typing import Any

import redis
from redis import exceptions

__all__ = ["RedisRefusal", "REFUSED_CLASSES", "REFUSALS", "refusal_code", "refusal_reason",
           "refusing_parser", "retrying_refusals"]


class RedisRefusal(exceptions.ResponseError):
    """Redis refused a command for a reason of its own state (``MISCONF``, ``BUSY``, ...):
    the same command may succeed later."""


#: What each refusal means, by Redis' error code.
REFUSALS: dict[str, str] = {
    "MISCONF": "the broker cannot write to its disk",
    "OOM": "the broker is out of memory (maxmemory reached) and takes no writes",
    "READONLY": "the broker is a read-only replica (a failover in progress?)",
    "NOSCRIPT": "the broker no longer has the script (restarted or flushed?)",
    "BUSY": "the broker is busy running a script",
    "LOADING": "the broker is loading its data set",
    "MASTERDOWN": "the broker is a replica that lost its master",
    "NOREPLICAS": "the broker has too few replicas to take writes",
    "TRYAGAIN": "the broker asks to try again",
}

#: The classes redis-py raises for refusals (with the code stripped from the message).
_CODE_OF_CLASS: tuple[tuple[type[BaseException], str], ...] = (
    (exceptions.OutOfMemoryError, "OOM"),
    (exceptions.ReadOnlyError, "READONLY"),
    (exceptions.NoScriptError, "NOSCRIPT"),
    (exceptions.BusyLoadingError, "LOADING"),
    (exceptions.MasterDownError, "MASTERDOWN"),
    (exceptions.TryAgainError, "TRYAGAIN"),
)

#: Every class a refusal may be raised as.
REFUSED_CLASSES: tuple[type[BaseException], ...] = (RedisRefusal,) + tuple(
    cls for cls, _ in _CODE_OF_CLASS)

# A code as a word of its own: at the start of the reply, after a script's "-", after a
# pipeline's "caused error: " (redis.asyncio's quotes the reply as a tuple: "('MISCONF ...',)").
_CODE = re.compile(r"(?<!\w)(" + "|".join(REFUSALS) + r")\b")


def refusal_code(exc: BaseException) -> str | None:
    """Redis' code (``MISCONF``, ``OOM``, ...) when ``exc`` is a refusal, else None."""
    if not isinstance(exc, exceptions.ResponseError):
        return None
    for cls, code in _CODE_OF_CLASS:
        if isinstance(exc, cls):
            return code
    match = _CODE.search(str(exc))
    return match.group(1) if match else None


def refusal_reason(exc: BaseException) -> str | None:
    """What a refusal means and Redis' own words, e.g. "the broker cannot write to its disk
    (MISCONF Errors writing to the AOF file: No space left on device)"; None when ``exc`` is no
    refusal."""
    code = refusal_code(exc)
    if code is None:
        return None
    said = (str(exc) or repr(exc)).strip()
    if code not in said:  # redis-py strips the code of the classes it maps
        said = f"{code} {said}".strip()
    elif not said.startswith(code):  # a script's error wraps Redis' words: quote those alone
        said = said[_CODE.search(said).start():]  # type: ignore[union-attr]
    return f"{REFUSALS[code]} ({said})"


def refusing_parser(base: type | None = None) -> type:
    """A redis-py parser class (``parser_class`` of a connection) that raises
    :class:`RedisRefusal` for a refusal redis-py would raise as a plain ``ResponseError``."""
    parent: Any = base or redis.connection.DefaultParser

    class RefusingParser(parent):  # type: ignore[misc, valid-type]
        @classmethod
        def parse_error(cls, response: str) -> Any:
            error = super().parse_error(response)
            if type(error) is exceptions.ResponseError and refusal_code(error):
                return RedisRefusal(*error.args)
            return error

    RefusingParser.__name__ = RefusingParser.__qualname__ = f"Refusing{parent.__name__}"
    return RefusingParser


def retrying_refusals(backend: Any) -> Any:
    """``backend`` (a Celery result backend) counting a refusal as safe to retry, as it counts a
    lost connection: with ``result_backend_always_retry`` (a worker sets it), a result Redis
    refuses to store is stored again with Celery's backoff, not lost."""
    safe = getattr(backend, "exception_safe_to_retry", None)
    if safe is None:
        return backend

    def exception_safe_to_retry(exc: BaseException) -> bool:
        return bool(safe(exc)) or refusal_code(exc) is not None

    backend.exception_safe_to_retry = exception_safe_to_retry
    return backend
