"""The system shared-memory extension's calls (gateway/shared_memory.py), as Triton serves them:

- HTTP: ``GET /v2/systemsharedmemory[/region/{name}]/status`` (a JSON list of ``{"name", "key",
  "offset", "byte_size"}``), ``POST /v2/systemsharedmemory/region/{name}/register`` (body
  ``{"key", "offset", "byte_size"}``), ``POST /v2/systemsharedmemory[/region/{name}]/unregister``
  (no name: every region); errors ``{"error": ...}``;
- gRPC: ``SystemSharedMemoryStatus``, ``SystemSharedMemoryRegister``,
  ``SystemSharedMemoryUnregister``.

The CUDA shared-memory calls: status answers no region and unregister succeeds (none is ever
registered: clients such as Triton's examples unregister every region first), register is refused
(HTTP 400, gRPC UNIMPLEMENTED): a gateway holds no device.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.proto import inference_pb2 as pb
from asyncinfer.gateway.shared_memory import SharedMemory
from asyncinfer.wire.envelope import printable

__all__ = ["http_routes", "grpc_methods", "NO_CUDA"]

#: Why a CUDA shared-memory call is refused.
NO_CUDA = ("CUDA shared memory is not served by this gateway (it holds no device): use system "
           "shared memory (/v2/systemsharedmemory) or send the data")

_REGIONS: web.AppKey[SharedMemory] = web.AppKey("shared_memory", SharedMemory)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body, separators=(",", ":")), status=status,
                        content_type="application/json")


def _answer(call: Any) -> Any:
    async def handler(request: web.Request) -> web.Response:
        try:
            return await call(request, request.app[_REGIONS], request.match_info.get("name", ""))
        except GatewayError as exc:
            return _json({"error": exc.message}, exc.status)

    return handler


async def _status(request: web.Request, regions: SharedMemory, name: str) -> web.Response:
    return _json(regions.status(name))


async def _register(request: web.Request, regions: SharedMemory, name: str) -> web.Response:
    regions.check_allowed()
    raw = await request.read()
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise GatewayError(400, f"failed to parse the register request: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the register request must be a JSON object")
    if "key" not in body:
        raise GatewayError(400, "Shared memory register request has no 'key' field")
    if "byte_size" not in body:
        raise GatewayError(400, "Shared memory register request has no 'byte_size' field")
    regions.register(name, body["key"], body.get("offset", 0), body["byte_size"])
    return _json({})


async def _unregister(request: web.Request, regions: SharedMemory, name: str) -> web.Response:
    regions.unregister(name)
    return _json({})


async def _cuda_status(request: web.Request, regions: SharedMemory, name: str) -> web.Response:
    if name:
        raise GatewayError(404, f"Unable to find cuda shared memory region: '{printable(name, 60)}'")
    return _json([])


async def _cuda_unregister(request: web.Request, regions: SharedMemory,
                           name: str) -> web.Response:
    return _json({})


async def _cuda_register(request: web.Request, regions: SharedMemory, name: str) -> web.Response:
    raise GatewayError(400, NO_CUDA)


def http_routes(app: web.Application, regions: SharedMemory) -> None:
    """Add the extension's routes to ``app``, serving ``regions``."""
    app[_REGIONS] = regions
    base = "/v2/systemsharedmemory"
    app.add_routes([
        web.get(f"{base}/status", _answer(_status)),
        web.get(base + "/region/{name}/status", _answer(_status)),
        web.post(base + "/region/{name}/register", _answer(_register)),
        web.post(f"{base}/unregister", _answer(_unregister)),
        web.post(base + "/region/{name}/unregister", _answer(_unregister)),
        web.get("/v2/cudasharedmemory/status", _answer(_cuda_status)),
        web.get("/v2/cudasharedmemory/region/{name}/status", _answer(_cuda_status)),
        web.post("/v2/cudasharedmemory/region/{name}/register", _answer(_cuda_register)),
        web.post("/v2/cudasharedmemory/unregister", _answer(_cuda_unregister)),
        web.post("/v2/cudasharedmemory/region/{name}/unregister", _answer(_cuda_unregister)),
    ])


def grpc_methods(regions: SharedMemory) -> dict[str, tuple[Any, Any, Any]]:
    """The extension's gRPC methods: name → (handler, request type, response type)."""

    async def status(request: pb.SystemSharedMemoryStatusRequest,
                     context: Any) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in regions.status(request.name):
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    async def register(request: pb.SystemSharedMemoryRegisterRequest,
                       context: Any) -> pb.SystemSharedMemoryRegisterResponse:
        regions.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def unregister(request: pb.SystemSharedMemoryUnregisterRequest,
                         context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        regions.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_status(request: pb.CudaSharedMemoryStatusRequest,
                          context: Any) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise GatewayError(404, f"Unable to find cuda shared memory region: "
                                    f"'{printable(request.name, 60)}'")
        return pb.CudaSharedMemoryStatusResponse()

    async def cuda_register(request: pb.CudaSharedMemoryRegisterRequest,
                            context: Any) -> pb.CudaSharedMemoryRegisterResponse:
        raise GatewayError(400, NO_CUDA, grpc_code="UNIMPLEMENTED")

    async def cuda_unregister(request: pb.CudaSharedMemoryUnregisterRequest,
                              context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    return {
        "CudaSharedMemoryStatus": (cuda_status, pb.CudaSharedMemoryStatusRequest,
                                   pb.CudaSharedMemoryStatusResponse),
        "CudaSharedMemoryRegister": (cuda_register, pb.CudaSharedMemoryRegisterRequest,
                                     pb.CudaSharedMemoryRegisterResponse),
        "CudaSharedMemoryUnregister": (cuda_unregister, pb.CudaSharedMemoryUnregisterRequest,
                                       pb.CudaSharedMemoryUnregisterResponse),
        "SystemSharedMemoryStatus": (status, pb.SystemSharedMemoryStatusRequest,
                                     pb.SystemSharedMemoryStatusResponse),
        "SystemSharedMemoryRegister": (register, pb.SystemSharedMemoryRegisterRequest,
                                       pb.SystemSharedMemoryRegisterResponse),
        "SystemSharedMemoryUnregister": (unregister, pb.SystemSharedMemoryUnregisterRequest,
                                         pb.SystemSharedMemoryUnregisterResponse),
    }
