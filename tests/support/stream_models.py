"""Streaming models only the tests register (ASYNCINFER_MODEL_FACTORIES): ``slow-echo``, the
built-in echo-stream at a slower, known pace, so that a test can act while a request streams."""

from __future__ import annotations

from asyncinfer.models.echo_stream import EchoStream

__all__ = ["SlowEcho", "SLOW_ECHO_FACTORY"]


class SlowEcho(EchoStream):
    """echo-stream at 0.02 s a step."""

    name = "slow-echo"
    step_s = 0.02


#: Its ``ASYNCINFER_MODEL_FACTORIES`` entry.
SLOW_ECHO_FACTORY = "slow-echo=tests.support.stream_models:SlowEcho"
