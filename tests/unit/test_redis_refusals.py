"""Redis' refusals told apart from real errors, in each form redis-py raises them, and named to
the producer in Redis' own words."""

from __future__ import annotations

import pytest
from redis import exceptions

from asyncinfer.broker.connections import broker_error
from asyncinfer.broker.refusals import (
    REFUSED_CLASSES,
    RedisRefusal,
    refusal_code,
    refusal_reason,
    refusing_parser,
    retrying_refusals,
)
from asyncinfer.broker.transport import SentinelTransport, Transport
from asyncinfer.errors import BrokerRefused, BrokerUnavailable

AOF_FULL = "MISCONF Errors writing to the AOF file: No space left on device"


@pytest.mark.parametrize(("exc", "code"), [
    (exceptions.ResponseError(AOF_FULL), "MISCONF"),
    (exceptions.ResponseError("Command # 1 (SET a b) of pipeline caused error: " + AOF_FULL),
     "MISCONF"),
    (exceptions.ResponseError("Error running script (call to f_ee5b): @user_script:1: "
                              "@user_script: 1: -" + AOF_FULL), "MISCONF"),
    (exceptions.ResponseError("Command # 1 (SET a b) of pipeline caused error: ('" + AOF_FULL
                              + "',)"), "MISCONF"),  # redis.asyncio's pipeline
    (exceptions.ResponseError("BUSY Redis is busy running a script."), "BUSY"),
    (exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "OOM"),
    (exceptions.ReadOnlyError("You can't write against a read only replica."), "READONLY"),
    (exceptions.NoScriptError("No matching script."), "NOSCRIPT"),
    (RedisRefusal(AOF_FULL), "MISCONF"),
    (exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
     None),
    (exceptions.ResponseError("ERR unknown command 'FOO', mentioning OOMPH and MISCONFIGURED"), None),
    (exceptions.ConnectionError("Connection refused"), None),
])
def test_a_refusal_is_found_in_each_form_redis_py_raises_it(exc: Exception, code: str | None) -> None:
    assert refusal_code(exc) == code
    assert (refusal_reason(exc) is None) == (code is None)


def test_the_reason_names_the_cause_and_quotes_redis() -> None:
    assert refusal_reason(exceptions.ResponseError(AOF_FULL)) == (
        "the broker cannot write to its disk (" + AOF_FULL + ")")
    # redis-py strips the code from the message of the classes it maps: it is put back
    assert refusal_reason(exceptions.OutOfMemoryError("command not allowed")) == (
        "the broker is out of memory (maxmemory reached) and takes no writes "
        "(OOM command not allowed)")


def test_broker_refused_names_redis_reason() -> None:
    err = broker_error("r-1", exceptions.ResponseError(AOF_FULL))
    assert isinstance(err, BrokerRefused)
    assert str(err) == ("request r-1: broker cannot write to its disk (" + AOF_FULL + "); not sent")
    oom = broker_error("r-2", exceptions.OutOfMemoryError("command not allowed"))
    assert str(oom).startswith("request r-2: broker is out of memory")
    # an error whose text is empty still says what it was
    assert str(broker_error("r-3", exceptions.ResponseError())) == (
        "request r-3: broker refused the request (ResponseError): ResponseError, with no message")
    assert isinstance(broker_error("r-4", exceptions.BusyLoadingError("loading")), BrokerUnavailable)


def test_the_refusing_parser_raises_a_refusal_class_and_keeps_redis_py_classes() -> None:
    parser = refusing_parser()
    misconf = parser.parse_error(AOF_FULL)
    assert type(misconf) is RedisRefusal and str(misconf) == AOF_FULL
    assert type(parser.parse_error("BUSY Redis is busy running a script.")) is RedisRefusal
    # the classes redis-py maps stay its own (its script runner reloads on NoScriptError)
    assert type(parser.parse_error("NOSCRIPT No matching script.")) is exceptions.NoScriptError
    assert type(parser.parse_error("OOM command not allowed")) is exceptions.OutOfMemoryError
    # other errors are untouched
    assert type(parser.parse_error("WRONGTYPE wrong kind")) is exceptions.ResponseError


def test_the_transports_count_refusals_as_connection_errors_not_only_channel_errors() -> None:
    for transport in (Transport, SentinelTransport):
        for cls in REFUSED_CLASSES:
            assert issubclass(cls, transport.connection_errors), (transport, cls)
        assert not issubclass(exceptions.ResponseError, transport.connection_errors)


def test_a_result_backend_retries_refusals_as_it_retries_lost_connections() -> None:
    class Backend:
        def exception_safe_to_retry(self, exc: BaseException) -> bool:
            return isinstance(exc, exceptions.ConnectionError)

    backend = retrying_refusals(Backend())
    assert backend.exception_safe_to_retry(exceptions.ResponseError(AOF_FULL))
    assert backend.exception_safe_to_retry(exceptions.ConnectionError("gone"))
    assert not backend.exception_safe_to_retry(exceptions.ResponseError("WRONGTYPE wrong kind"))
