"""The v2 REST front (aiohttp): health, server and model metadata, model config, infer, and
Triton's generate extension (``generate``, and ``generate_stream`` as server-sent events).

Errors are ``{"error": "..."}`` with the status :class:`~asyncinfer.gateway.call_errors.GatewayError`
carries (429 adds ``Retry-After``); aiohttp's own refusals (no such route 404, method 405, body
too large 413) are answered in the same form. Request bodies compressed with gzip or deflate
(``Content-Encoding``) are inflated here, not by aiohttp's parser (``auto_decompress=False``): at
most ``max_body_bytes`` come out, so a small body that inflates past the limit (a "zip bomb")
is refused with 413 after that much work, not inflated to its end on the event loop; a body that
is not what its ``Content-Encoding`` says is a 400, an encoding other than gzip, deflate or
identity a 415. A response of ``MIN_COMPRESSED_BYTES`` or more is compressed when the client
accepts it. A client that disconnects
cancels its handler (``handler_cancellation``), and the service revokes its request. Connections
are capped, and a request's header and body must arrive in time (connections.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from typing import Any

from aiohttp import web

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway import shared_memory_api
from asyncinfer.gateway.binary import HEADER_LENGTH, parse_infer_body, render_infer_result
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.connections import ConnectionGuard, GuardedSite
from asyncinfer.gateway.generate import generate_call, generate_response
from asyncinfer.gateway.idempotency import HEADER as IDEMPOTENCY_HEADER
from asyncinfer.gateway.service import Service, off_loop_if_large
from asyncinfer.gateway.streaming import Interrupted, stream
from asyncinfer.gateway.tensors import InferCall
from asyncinfer.wire.trace_context import trace_fields

__all__ = ["make_app", "start_http"]

#: An answer smaller than this goes uncompressed though the client accepts gzip or deflate (as web
#: servers' ``gzip_min_length``): compressing a small tensor cost ~9 % of an HTTP call
#: (``zlib.compressobj``'s tables) to save a few bytes, and every aiohttp client (so
#: ``tritonclient.http.aio``) accepts gzip by default.
MIN_COMPRESSED_BYTES = 1024

_SERVICE: web.AppKey[Service] = web.AppKey("service", Service)
_MAX_BODY: web.AppKey[int] = web.AppKey("max_body_bytes", int)

#: Content-Encoding → zlib ``wbits`` of the request bodies the infer route inflates.
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body, separators=(",", ":")), status=status,
                        content_type="application/json")


def _error(exc: GatewayError) -> web.Response:
    response = _json({"error": exc.message}, exc.status)
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = f"{max(1, round(exc.retry_after_s))}"
    return response


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


async def live(request: web.Request) -> web.Response:
    return _json({"live": request.app[_SERVICE].live()})


async def ready(request: web.Request) -> web.Response:
    is_ready = request.app[_SERVICE].ready()
    return _json({"ready": is_ready}, 200 if is_ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return _json(request.app[_SERVICE].server_metadata())


async def model_metadata(request: web.Request) -> web.Response:
    try:
        return _json(await request.app[_SERVICE].model_metadata(*_model(request)))
    except GatewayError as exc:
        return _error(exc)


async def model_config(request: web.Request) -> web.Response:
    try:
        return _json(await request.app[_SERVICE].model_config(*_model(request)))
    except GatewayError as exc:
        return _error(exc)


async def model_statistics(request: web.Request) -> web.Response:
    """Triton's statistics extension: every model's (``/v2/models/stats``) or one model's."""
    model = request.match_info.get("model", "")
    try:
        return _json(await request.app[_SERVICE].model_statistics(
            model, request.match_info.get("version", "")))
    except GatewayError as exc:
        return _error(exc)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """A repository call's JSON object body ({} when empty); GatewayError 400 if it is none."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise GatewayError(400, f"{request.path}: the body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"{request.path}: the body must be a JSON object")
    return body


async def repository_index(request: web.Request) -> web.Response:
    """Triton's repository index: ``[{"name", "version", "state", "reason"}]`` (body
    ``{"ready": true}``: the ready models only)."""
    try:
        body = await _json_body(request)
        ready_only = body.get("ready", False)
        if not isinstance(ready_only, bool):
            raise GatewayError(400, f"repository index: 'ready' must be true or false, got "
                                    f"{ready_only!r:.40}")
        return _json(await request.app[_SERVICE].repository_index(ready_only))
    except GatewayError as exc:
        return _error(exc)


async def _control(request: web.Request, action: str) -> web.Response:
    try:
        body = await _json_body(request)
        parameters = body.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise GatewayError(400, f"{action}: 'parameters' must be a JSON object")
        return _json(await request.app[_SERVICE].control_model(
            action, request.match_info["model"], parameters))
    except GatewayError as exc:
        return _error(exc)


async def load_model(request: web.Request) -> web.Response:
    return await _control(request, "load")


async def unload_model(request: web.Request) -> web.Response:
    return await _control(request, "unload")


async def model_ready(request: web.Request) -> web.Response:
    service = request.app[_SERVICE]
    model, version = _model(request)
    try:
        entry = await service.entry(model, version)
    except GatewayError as exc:
        return _json({"name": model, "ready": False, "error": exc.message}, exc.status)
    return _json({"name": model, "ready": entry.ready}, 200 if entry.ready else 503)


async def infer(request: web.Request) -> web.StreamResponse:
    service = request.app[_SERVICE]
    model, version = _model(request)
    limit = request.app[_MAX_BODY]
    header_length = request.headers.get(HEADER_LENGTH)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    try:
        if encoding not in ("", "identity", *_ENCODINGS):
            raise GatewayError(415, f"request body has Content-Encoding {encoding!r:.40}; "
                                    f"accepted: gzip, deflate, identity")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, f"request body is larger than the gateway's limit of {limit} "
                                    f"bytes (ASYNCINFER_MAX_PAYLOAD_BYTES)") from None
        if encoding in _ENCODINGS:
            body = await asyncio.get_running_loop().run_in_executor(None, _inflate, encoding, body,
                                                                    limit)
        call = await off_loop_if_large(len(body), parse_infer_body, model, version, body, header_length)
        call.trace = trace_fields(request.headers)  # the caller's traceparent, if any
        call.idempotency_key = request.headers.get(IDEMPOTENCY_HEADER, "")
        result = await service.infer(call)
        out, json_length = await off_loop_if_large(
            sum(len(o.raw) for o in result.outputs), render_infer_result, call, result)
    except InvalidRequest as exc:
        return _error(GatewayError(400, str(exc)))
    except GatewayError as exc:
        return _error(exc)
    if json_length is None:
        response = web.Response(body=out, content_type="application/json")
    else:
        response = web.Response(body=out, content_type="application/octet-stream",
                                headers={HEADER_LENGTH: str(json_length)})
    accepted = request.headers.get("Accept-Encoding", "")
    if len(out) >= MIN_COMPRESSED_BYTES and ("gzip" in accepted or "deflate" in accepted):
        response.enable_compression()
    return response


async def _generate_call(request: web.Request) -> InferCall:
    """The call of a generate request (Triton's generate extension: gateway/generate.py).

    Raises:
        GatewayError: 404 for an unknown model, 413 for a body over the limit, 415 for a
            compressed body (generate takes identity bodies only, as Triton's does).
        InvalidRequest: a body that is not a generate request.
    """
    service = request.app[_SERVICE]
    model, version = _model(request)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise GatewayError(415, f"request body has Content-Encoding {encoding!r:.40}; generate "
                                f"takes identity bodies only")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(413, f"request body is larger than the gateway's limit of "
                                f"{request.app[_MAX_BODY]} bytes (ASYNCINFER_MAX_PAYLOAD_BYTES)") from None
    entry = await service.entry(model, version)
    call = await off_loop_if_large(len(body), generate_call, model, version, body,
                                   list(entry.metadata.get("inputs") or []))
    call.idempotency_key = request.headers.get(IDEMPOTENCY_HEADER, "")
    return call


async def generate(request: web.Request) -> web.Response:
    """``POST …/generate``: the request's one answer (a decoupled model's parts joined)."""
    try:
        call = await _generate_call(request)
        result = await request.app[_SERVICE].infer(call)
        return _json(await off_loop_if_large(sum(len(o.raw) for o in result.outputs),
                                             generate_response, result))
    except InvalidRequest as exc:
        return _error(GatewayError(400, str(exc)))
    except GatewayError as exc:
        return _error(exc)


def _event(body: Any, kind: str = "") -> bytes:
    """One server-sent event: ``data: <json>``, after ``event: <kind>`` when given."""
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """``POST …/generate_stream``: server-sent events, one ``data:`` event per part in order;
    ``event: interrupted`` when the request's worker died and it resumes; an error after the
    first event is ``data: {"error": ...}``, then the end. An error before any event is a JSON
    error with its status, as ``generate``'s. A client that hangs up revokes the request (its
    handler is cancelled, or its write fails: either closes the stream, which revokes)."""
    response: web.StreamResponse | None = None
    try:
        call = await _generate_call(request)
        async with contextlib.aclosing(stream(request.app[_SERVICE], call)) as events:
            async for event in events:
                if isinstance(event, Interrupted):
                    chunk = _event({**({"id": call.id} if call.id else {}),
                                    "interrupted": event.message}, "interrupted")
                else:
                    chunk = _event(generate_response(event.result))
                if response is None:
                    response = await _start_events(request)
                await response.write(chunk)
    except (InvalidRequest, GatewayError) as exc:
        error = exc if isinstance(exc, GatewayError) else GatewayError(400, str(exc))
        if response is None:
            return _error(error)
        await response.write(_event({"error": error.message}))
    except ConnectionResetError:  # the client hung up; closing the stream revoked the request
        return response or web.Response(status=499)
    if response is None:  # a stream without parts
        response = await _start_events(request)
    await response.write_eof()
    return response


async def _start_events(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def _inflate(encoding: str, body: bytes, limit: int) -> bytes:
    """``body`` inflated as its ``Content-Encoding`` (gzip or deflate) says, at most ``limit``
    bytes of it.

    Raises:
        GatewayError: 400 for data that is not of that encoding (or is cut short), 413 when it
            inflates to more than ``limit`` bytes.
    """
    wbits = _ENCODINGS[encoding]
    if encoding == "deflate" and body and body[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate without the zlib header, as some clients send it
    parts, size, rest = [], 0, body
    try:
        while rest:  # gzip allows members one after another
            inflater = zlib.decompressobj(wbits)
            part = inflater.decompress(rest, limit + 1 - size)
            size += len(part)
            if size > limit:
                raise GatewayError(413, f"request body inflates to more than the gateway's limit "
                                        f"of {limit} bytes (ASYNCINFER_MAX_PAYLOAD_BYTES)")
            parts.append(part)
            if not inflater.eof:
                raise GatewayError(400, f"request body is cut short: its {encoding} data ends "
                                        f"before the end of the stream")
            rest = inflater.unused_data if wbits == _ENCODINGS["gzip"] else b""
    except zlib.error as exc:
        raise GatewayError(400, f"request body is not valid {encoding} data "
                                f"(Content-Encoding: {encoding}): {exc}") from None
    return b"".join(parts)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (404 no route, 405 method, 413 body too large) as v2 JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPMethodNotAllowed):
            message = (f"method {exc.method} is not allowed on {request.path} (allowed: "
                       f"{', '.join(sorted(exc.allowed_methods))})")
        elif isinstance(exc, web.HTTPNotFound):
            message = f"no such route: {request.method} {request.path}"
        else:
            message = exc.text or exc.reason
        response = _json({"error": message}, exc.status)
        for key, value in exc.headers.items():
            if key.lower() not in ("content-type", "content-length"):
                response.headers[key] = value
        return response


def make_app(service: Service, *, max_body_bytes: int) -> web.Application:
    """The REST front's application; serve it with ``auto_decompress=False`` (as
    :func:`start_http` does): its infer route inflates compressed bodies itself."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_json_errors])
    app[_SERVICE] = service
    app[_MAX_BODY] = max_body_bytes
    app.add_routes([
        web.get("/v2/health/live", live),
        web.get("/v2/health/ready", ready),
        web.get("/v2", server_metadata),
        web.get("/v2/models/stats", model_statistics),
        web.get("/v2/models/{model}/stats", model_statistics),
        web.get("/v2/models/{model}/versions/{version}/stats", model_statistics),
        web.get("/v2/models/{model}", model_metadata),
        web.get("/v2/models/{model}/versions/{version}", model_metadata),
        web.get("/v2/models/{model}/ready", model_ready),
        web.get("/v2/models/{model}/versions/{version}/ready", model_ready),
        web.get("/v2/models/{model}/config", model_config),
        web.get("/v2/models/{model}/versions/{version}/config", model_config),
        web.post("/v2/repository/index", repository_index),
        web.post("/v2/repository/models/{model}/load", load_model),
        web.post("/v2/repository/models/{model}/unload", unload_model),
        web.post("/v2/models/{model}/infer", infer),
        web.post("/v2/models/{model}/versions/{version}/infer", infer),
        web.post("/v2/models/{model}/generate", generate),
        web.post("/v2/models/{model}/versions/{version}/generate", generate),
        web.post("/v2/models/{model}/generate_stream", generate_stream),
        web.post("/v2/models/{model}/versions/{version}/generate_stream", generate_stream),
    ])
    shared_memory_api.http_routes(app, service.shared_memory)
    return app


#: An idle keep-alive connection is closed after this long (aiohttp's own default is an hour).
KEEPALIVE_S = 75.0


async def start_http(service: Service, host: str, port: int, *, max_body_bytes: int,
                     shutdown_timeout_s: float = 5.0, reuse_port: bool = False,
                     max_connections: int = 1000, header_timeout_s: float = 10.0,
                     body_timeout_s: float = 60.0) -> web.AppRunner:
    """Serve the REST front on ``host:port``; stop with ``await runner.cleanup()`` (calls still
    running get ``shutdown_timeout_s``, then are cut off). Request bodies reach the handlers as
    sent (``auto_decompress=False``): the infer route inflates them, bounded. ``reuse_port``:
    share the port with other processes that set it (``SO_REUSEPORT``). At most
    ``max_connections`` are open; a request's header must arrive within ``header_timeout_s``, its
    body ``body_timeout_s`` after (:class:`~asyncinfer.gateway.connections.ConnectionGuard`)."""
    app = make_app(service, max_body_bytes=max_body_bytes)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s, auto_decompress=False,
                           keepalive_timeout=KEEPALIVE_S)
    guard = ConnectionGuard(lambda: _protocol(runner), max_connections=max_connections,
                            header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s)
    app.middlewares.insert(0, guard.middleware)  # first: it sees each request as it begins
    await runner.setup()
    await GuardedSite(runner, guard, host, port, reuse_port=reuse_port).start()
    return runner


def _protocol(runner: web.AppRunner) -> asyncio.Protocol:
    server = runner.server
    assert server is not None  # set up before the site starts
    return server()
