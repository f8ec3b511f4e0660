"""The REST front's connection guard (gateway/connections.py) and the caps it is given
(gateway/open_files.py), on an event loop with stand-in transports and requests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from asyncinfer.gateway.connections import BUSY_RESPONSE, ConnectionGuard
from asyncinfer.gateway.open_files import Caps, connection_caps

SHORT_S = 0.05


class Inner(asyncio.Protocol):
    """aiohttp's protocol as the guard sees it: what it was told."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.events.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")


class Transport(asyncio.Transport):
    """Closing it tells its protocol on the next turn of the loop, as asyncio's do."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False
        self.protocol: asyncio.Protocol | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        if not self.closed and self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@dataclass
class Content:
    eof: bool = True

    def is_eof(self) -> bool:
        return self.eof


@dataclass
class Request:
    transport: Transport
    content: Content = field(default_factory=Content)


def _guard(max_connections: int = 3, header_timeout_s: float = 10.0,
           body_timeout_s: float = 10.0) -> tuple[ConnectionGuard, list[Inner]]:
    inners: list[Inner] = []

    def make() -> asyncio.Protocol:
        inners.append(Inner())
        return inners[-1]

    return ConnectionGuard(make, max_connections=max_connections,
                           header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s), inners


def _connect(guard: ConnectionGuard) -> Transport:
    transport = Transport()
    transport.protocol = guard.protocol()
    transport.protocol.connection_made(transport)
    return transport


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def _in_request(guard: ConnectionGuard, request: Request) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """A request of ``request.transport`` held in its handler until the event is set."""
    release = asyncio.Event()

    async def handler(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response()

    middleware: Callable[..., Awaitable[web.StreamResponse]] = guard.middleware
    return release, asyncio.ensure_future(middleware(request, handler))


def test_at_the_cap_a_newcomer_closes_the_longest_idle_connection() -> None:
    async def scenario() -> None:
        guard, inners = _guard(max_connections=3)
        first, second, third = (_connect(guard) for _ in range(3))
        # second was in a request and went idle again: it is now the most recently idle
        release, handled = _in_request(guard, Request(second))
        await _settle()
        release.set()
        await handled

        fourth = _connect(guard)
        await _settle()

        assert (first.closed, second.closed, third.closed, fourth.closed) == (True, False, False,
                                                                              False)
        assert inners[0].events == ["made", "lost"]
        assert (guard.open, guard.evicted, guard.refused) == (3, 1, 0)
        fifth = _connect(guard)
        await _settle()
        assert third.closed and not second.closed and not fifth.closed
        assert guard.evicted == 2

    asyncio.run(scenario())


def test_at_the_cap_with_every_connection_in_a_request_a_newcomer_gets_a_503() -> None:
    async def scenario() -> None:
        guard, inners = _guard(max_connections=2)
        held = [_in_request(guard, Request(_connect(guard))) for _ in range(2)]
        await _settle()

        refused = _connect(guard)

        assert refused.written == BUSY_RESPONSE and refused.closed
        assert BUSY_RESPONSE.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert (guard.open, guard.refused, guard.evicted, len(inners)) == (2, 1, 0, 2)
        for release, handled in held:
            release.set()
            await handled
        again = _connect(guard)  # both idle again: the longest idle makes room
        await _settle()
        assert again.written == b"" and not again.closed
        assert (guard.refused, guard.evicted) == (1, 1)

    asyncio.run(scenario())


def test_a_connection_without_a_complete_header_in_time_is_closed() -> None:
    async def scenario() -> None:
        guard, inners = _guard(header_timeout_s=SHORT_S)
        slow = _connect(guard)
        served = _connect(guard)
        release, handled = _in_request(guard, Request(served))
        await _settle()
        for _ in range(8):  # a byte now and then does not reset the clock
            assert slow.protocol is not None
            if slow.closed:
                break
            slow.protocol.data_received(b"P")
            await asyncio.sleep(SHORT_S / 4)
        await _settle()

        assert slow.closed and inners[0].events[0] == "made" and inners[0].events[-1] == "lost"
        assert 2 <= inners[0].events.count(b"P") < 8
        assert not served.closed  # its header came: it is being handled
        assert guard.header_timeouts == 1 and guard.open == 1
        release.set()
        await handled
        await asyncio.sleep(SHORT_S * 2)
        assert not served.closed  # idle between requests: the keep-alive timeout's to close
        assert served.protocol is not None
        served.protocol.data_received(b"G")  # a later request begins, and stalls
        await asyncio.sleep(SHORT_S * 2)
        assert served.closed and guard.header_timeouts == 2

    asyncio.run(scenario())


def test_a_body_that_does_not_arrive_in_time_closes_its_connection() -> None:
    async def scenario() -> None:
        guard, _ = _guard(header_timeout_s=SHORT_S, body_timeout_s=2 * SHORT_S)
        stalled, complete = Request(_connect(guard), Content(eof=False)), Request(_connect(guard))
        _, stalled_handler = _in_request(guard, stalled)
        release, complete_handler = _in_request(guard, complete)
        await asyncio.sleep(SHORT_S * 4)

        assert stalled.transport.closed and guard.body_timeouts == 1
        assert not complete.transport.closed  # its body is in: a slow model is not a slow caller
        stalled_handler.cancel()  # aiohttp cancels the handler of a connection lost
        release.set()
        await complete_handler

    asyncio.run(scenario())


@pytest.mark.parametrize(("open_files", "given", "caps"), [
    (1024, 0, Caps(http=576, grpc=192)),         # a reserve of 256
    (65536, 0, Caps(http=43008, grpc=14336)),    # an eighth held back
    (300, 0, Caps(http=113, grpc=37)),           # half of a small limit
    (1024, 100, Caps(http=100, grpc=100)),       # ASYNCINFER_GATEWAY_MAX_CONNECTIONS
])
def test_connection_caps(open_files: int, given: int, caps: Caps) -> None:
    assert connection_caps(open_files, given) == caps


def test_a_guard_needs_room_for_one_connection() -> None:
    with pytest.raises(ValueError, match="max_connections must be >= 1, got 0"):
        _guard(max_connections=0)
