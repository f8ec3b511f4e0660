"""The v2 REST front (aiohttp): health, server and model metadata, model config, infer.

Errors are ``{"error": "..."}`` with the status :class:`~asyncinfer.gateway.service.GatewayError`
carries (429 adds ``Retry-After``). Request bodies compressed with gzip or deflate
(``Content-Encoding``) are inflated by aiohttp's parser; a response is compressed when the client
accepts it. A client that disconnects cancels its handler (``handler_cancellation``), and the
service revokes its request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.binary import HEADER_LENGTH, parse_infer_body, render_infer_result
from asyncinfer.gateway.service import OFF_LOOP_BYTES, GatewayError, Service

__all__ = ["make_app", "start_http"]

_SERVICE: web.AppKey[Service] = web.AppKey("service", Service)


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
    body = await request.read()
    header_length = request.headers.get(HEADER_LENGTH)
    try:
        call = await _off_loop_if_large(len(body), parse_infer_body, model, version, body, header_length)
        result = await service.infer(call)
        out, json_length = await _off_loop_if_large(
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
    if "gzip" in request.headers.get("Accept-Encoding", "") or "deflate" in request.headers.get(
            "Accept-Encoding", ""):
        response.enable_compression()
    return response


async def _off_loop_if_large(size: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, in the executor when it handles more than ``OFF_LOOP_BYTES`` (large tensors
    are decoded and encoded off the event loop)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def make_app(service: Service, *, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes)
    app[_SERVICE] = service
    app.add_routes([
        web.get("/v2/health/live", live),
        web.get("/v2/health/ready", ready),
        web.get("/v2", server_metadata),
        web.get("/v2/models/{model}", model_metadata),
        web.get("/v2/models/{model}/versions/{version}", model_metadata),
        web.get("/v2/models/{model}/ready", model_ready),
        web.get("/v2/models/{model}/versions/{version}/ready", model_ready),
        web.get("/v2/models/{model}/config", model_config),
        web.get("/v2/models/{model}/versions/{version}/config", model_config),
        web.post("/v2/models/{model}/infer", infer),
        web.post("/v2/models/{model}/versions/{version}/infer", infer),
    ])
    return app


async def start_http(service: Service, host: str, port: int, *, max_body_bytes: int,
                     shutdown_timeout_s: float = 5.0) -> web.AppRunner:
    """Serve the REST front on ``host:port``; stop with ``await runner.cleanup()`` (calls still
    running get ``shutdown_timeout_s``, then are cut off)."""
    runner = web.AppRunner(make_app(service, max_body_bytes=max_body_bytes), handler_cancellation=True,
                           access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

