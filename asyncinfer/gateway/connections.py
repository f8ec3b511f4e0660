"""The REST front's connections: capped, and timed while a request arrives.

aiohttp's server has no read timeout: a connection that never completes its request header holds
its socket until the keep-alive timeout, and one that stops sending its body holds it forever.
Nor does it cap connections: past the open-files limit every accept fails and new callers time
out. :class:`ConnectionGuard` stands between the listening socket and aiohttp's protocol:

- a connection must send a complete request header within ``header_timeout_s`` of connecting
  (a later request on a kept-alive connection: of its first byte), and the body within
  ``body_timeout_s`` of the header; past either it is closed (a slowloris sending a byte a second
  is cut off; an idle connection that never sent a request too);
- at most ``max_connections`` are open. At the cap a new connection first closes the one that
  has been idle longest (not in a request: never sent one, or between requests, or still sending
  its header), as nginx drains idle keep-alive connections when out of connections: idle callers
  cannot keep a working one out. When every open connection is in a request, the newcomer gets a
  503 and is closed at once.

Which connection is in a request it learns from :meth:`ConnectionGuard.middleware`, the app's
first middleware: a request reaches it once its header is parsed, and leaves it once handled.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web

__all__ = ["ConnectionGuard", "GuardedSite", "BUSY_RESPONSE"]

log = logging.getLogger(__name__)

_BUSY_MESSAGE = json.dumps({"error": "the gateway holds as many connections as it may, each one "
                                     "in a request; try again shortly"}).encode()
#: The whole answer a connection over the cap gets, before it is closed.
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                 b"Retry-After: 1\r\nConnection: close\r\n"
                 + f"Content-Length: {len(_BUSY_MESSAGE)}\r\n\r\n".encode() + _BUSY_MESSAGE)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ConnectionGuard:
    """Caps and times the connections of one listening socket; serve with :meth:`protocol` as
    the protocol factory and :meth:`middleware` first among the app's middlewares.

    ``make_protocol``: aiohttp's (``runner.server``), one per connection. The counts of
    connections closed for each reason are attributes (``header_timeouts``, ``body_timeouts``,
    ``evicted``, ``refused``)."""

    def __init__(self, make_protocol: Callable[[], asyncio.Protocol], *, max_connections: int,
                 header_timeout_s: float, body_timeout_s: float) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        self._make_protocol = make_protocol
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self._open: set[_Connection] = set()
        # Not in a request, longest idle first: who goes when a newcomer finds the cap reached.
        self._idle: OrderedDict[_Connection, None] = OrderedDict()
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self.header_timeouts = self.body_timeouts = self.evicted = self.refused = 0

    @property
    def open(self) -> int:
        """Connections open (or accepted and about to be)."""
        return len(self._open)

    def protocol(self) -> asyncio.Protocol:
        """The protocol of a connection just accepted (``loop.create_server``'s factory)."""
        if len(self._open) >= self.max_connections:
            if not self._idle:
                self.refused += 1
                log.warning("HTTP connection refused with a 503: %d open, the cap, all in "
                            "requests", len(self._open))
                return _Refused()
            oldest, _ = self._idle.popitem(last=False)
            self.evicted += 1
            log.info("HTTP connections at the cap (%d): closed the longest idle to take a new one",
                     self.max_connections)
            oldest.close()
        connection = _Connection(self, self._make_protocol())
        self._open.add(connection)
        self._idle[connection] = None
        return connection

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Marks the request's connection as in a request while it is handled (its header is in;
        its body has ``body_timeout_s`` to arrive)."""
        connection = self._by_transport.get(request.transport)  # type: ignore[arg-type]
        if connection is None:
            return await handler(request)
        connection.request_started(request)
        try:
            return await handler(request)
        finally:
            connection.request_ended()

    # -- what a connection tells its guard -------------------------------------------------------

    def _made(self, connection: _Connection, transport: asyncio.BaseTransport) -> None:
        self._by_transport[transport] = connection

    def _busy(self, connection: _Connection) -> None:
        self._idle.pop(connection, None)

    def _idle_again(self, connection: _Connection) -> None:
        if connection in self._open:
            self._idle[connection] = None

    def _gone(self, connection: _Connection) -> None:
        self._open.discard(connection)
        self._idle.pop(connection, None)
        if connection.transport is not None:
            self._by_transport.pop(connection.transport, None)

    def _timed_out(self, connection: _Connection, what: str) -> None:
        if what == "header":
            self.header_timeouts += 1
            log.info("closed an HTTP connection that sent no complete request header in %g s",
                     self.header_timeout_s)
        else:
            self.body_timeouts += 1
            log.info("closed an HTTP connection whose request body did not arrive in %g s",
                     self.body_timeout_s)


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the guard's timers and counts."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self.transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._request: web.Request | None = None
        self._closed = False
        self._inner_made = False

    # -- asyncio.Protocol, passed on to aiohttp's ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self._closed:  # evicted before it was made
            transport.close()
            return
        self._guard._made(self, transport)
        self._inner_made = True
        self._inner.connection_made(transport)
        self._arm(self._guard.header_timeout_s, "header")

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._timer is None and self._request is None:
            self._arm(self._guard.header_timeout_s, "header")  # a later request begins
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._guard._gone(self)
        if self._inner_made:
            self._inner.connection_lost(exc)

    # -- what the guard and its middleware do ----------------------------------------------------

    def close(self) -> None:
        """Close it now (evicted, or timed out); its fd is free once the loop has run again."""
        self._closed = True
        self._disarm()
        self._guard._gone(self)
        if self.transport is not None:
            self.transport.close()

    def request_started(self, request: web.Request) -> None:
        self._guard._busy(self)
        self._request = request
        self._disarm()
        if not request.content.is_eof():
            self._arm(self._guard.body_timeout_s, "body")

    def request_ended(self) -> None:
        self._request = None
        self._disarm()  # idle: aiohttp's keep-alive timeout closes it, or a new request arms
        self._guard._idle_again(self)

    # -- timers ----------------------------------------------------------------------------------

    def _arm(self, delay_s: float, what: str) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._expire, what)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, what: str) -> None:
        self._timer = None
        if what == "body" and (self._request is None or self._request.content.is_eof()):
            return  # the body is in: the call is being handled
        self._guard._timed_out(self, what)
        self.close()


class _Refused(asyncio.Protocol):
    """A connection over the cap when none can be closed for it: a 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(BUSY_RESPONSE)
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site, its connections made through ``guard`` (its protocol factory)."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *,
                 reuse_port: bool = False) -> None:
        super().__init__(runner)
        self._guard = guard
        self._host, self._port, self._reuse_port = host, port, reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.protocol, self._host, self._port,
                                                backlog=self._backlog,
                                                reuse_port=self._reuse_port or None)
