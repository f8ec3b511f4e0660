"""The v2 gRPC front: KServe v2 / Triton's ``inference.GRPCInferenceService``.

Triton's clients (``tritonclient.grpc``, perf_analyzer, ...) call it as they call Triton: the
messages (proto/inference.proto) carry Triton's field numbers, and the methods are registered
under Triton's service name. Only the calls the gateway can answer are registered (health,
metadata, model config, infer, streaming infer (grpc_stream.py), model statistics); any other
method of the service (RepositoryIndex, shared memory, ...) gets gRPC's own UNIMPLEMENTED.

Errors are aborts with the gRPC code :class:`~asyncinfer.gateway.call_errors.GatewayError` maps to
(429 → RESOURCE_EXHAUSTED also sends ``retry-after`` trailing metadata, in seconds). A client
that cancels, or whose deadline passes, cancels its handler; the service then revokes the request.
A client's deadline also becomes the request's expiry.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway import shared_memory_api
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.grpc_messages import infer_call, infer_response
from asyncinfer.gateway.grpc_stream import stream_infer_handler
from asyncinfer.gateway.idempotency import METADATA as IDEMPOTENCY_METADATA
from asyncinfer.gateway.proto import inference_pb2 as pb
from asyncinfer.gateway.service import Service, off_loop_if_large
from asyncinfer.wire.trace_context import trace_fields_of_pairs

__all__ = ["start_grpc", "SERVICE_NAME", "MAX_MESSAGE_BYTES"]

log = logging.getLogger(__name__)

#: The service name Triton's clients call (the proto package of Triton's grpc_service.proto).
SERVICE_NAME = "inference.GRPCInferenceService"
#: Largest message either way by default (gRPC's own default, 4 MiB, is too small for tensors).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


# -- metadata ------------------------------------------------------------------------------------

def _tensor_metadata(tensor: Mapping[str, Any]) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=str(tensor["name"]), datatype=str(tensor["datatype"]),
        shape=[int(d) for d in tensor.get("shape") or []])


def _data_type(name: str) -> pb.DataType:
    """A ``TYPE_*`` name as a DataType (TYPE_INVALID for one Triton does not have)."""
    return pb.DataType.Value(name) if name in pb.DataType.keys() else pb.TYPE_INVALID


def _input_format(name: str) -> pb.ModelInput.Format:
    """A ``FORMAT_*`` name as Triton's ModelInput.Format (FORMAT_NONE for any other)."""
    formats = pb.ModelInput.Format
    return formats.Value(name) if name in formats.keys() else pb.ModelInput.FORMAT_NONE


def _model_config(config: Mapping[str, Any]) -> pb.ModelConfig:
    return pb.ModelConfig(
        name=str(config["name"]), platform=str(config.get("platform", "")),
        backend=str(config.get("backend", "")), max_batch_size=int(config.get("max_batch_size", 0)),
        input=[pb.ModelInput(name=str(t["name"]), data_type=_data_type(str(t["data_type"])),
                             format=_input_format(str(t.get("format", ""))),
                             dims=[int(d) for d in t["dims"]]) for t in config.get("input", [])],
        output=[pb.ModelOutput(name=str(t["name"]), data_type=_data_type(str(t["data_type"])),
                               dims=[int(d) for d in t["dims"]],
                               label_filename=str(t.get("label_filename", "")))
                for t in config.get("output", [])],
        dynamic_batching=_dynamic_batching(config.get("dynamic_batching")),
        instance_group=[pb.ModelInstanceGroup(
            name=str(g.get("name", "")), count=int(g.get("count", 1)),
            kind=pb.ModelInstanceGroup.Kind.Value(str(g.get("kind", "KIND_AUTO"))))
            for g in config.get("instance_group", [])],
        model_transaction_policy=pb.ModelTransactionPolicy(
            decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False))))


def _dynamic_batching(batching: Mapping[str, Any] | None) -> pb.ModelDynamicBatching | None:
    if not batching:
        return None
    return pb.ModelDynamicBatching(
        preferred_batch_size=[int(s) for s in batching.get("preferred_batch_size", [])],
        max_queue_delay_microseconds=int(batching.get("max_queue_delay_microseconds", 0)))


def _statistics_response(model_stats: list[Mapping[str, Any]]) -> pb.ModelStatisticsResponse:
    """Triton's ModelStatisticsResponse of the statistics' JSON form (its extra key left out)."""
    response = pb.ModelStatisticsResponse()
    for entry in model_stats:
        stats = response.model_stats.add(
            name=entry["name"], version=entry["version"], last_inference=entry["last_inference"],
            inference_count=entry["inference_count"], execution_count=entry["execution_count"])
        for name, duration in entry["inference_stats"].items():
            getattr(stats.inference_stats, name).CopyFrom(pb.StatisticDuration(**duration))
        for batch in entry["batch_stats"]:
            stats.batch_stats.add(**{k: v if k == "batch_size" else pb.StatisticDuration(**v)
                                     for k, v in batch.items()})
    return response


def _repository_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> dict[str, Any]:
    """A load or unload's parameters as plain values (each its oneof's)."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, which) if which is not None else None
    return values


# -- the methods ---------------------------------------------------------------------------------

def _methods(service: Service) -> dict[str, tuple[Handler, type[Message], type[Message]]]:
    """Method name → (handler, request message, response message)."""

    async def server_live(request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=service.live())

    async def server_ready(request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=service.ready())

    async def model_ready(request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        # An unknown model is not ready, not an error (as Triton answers).
        return pb.ModelReadyResponse(ready=await service.model_ready(request.name, request.version))

    async def server_metadata(request: pb.ServerMetadataRequest,
                              context: Any) -> pb.ServerMetadataResponse:
        meta = service.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                         extensions=meta["extensions"])

    async def model_metadata(request: pb.ModelMetadataRequest,
                             context: Any) -> pb.ModelMetadataResponse:
        meta = await service.model_metadata(request.name, request.version)
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=[str(v) for v in meta["versions"]], platform=meta["platform"],
            inputs=[_tensor_metadata(t) for t in meta["inputs"]],
            outputs=[_tensor_metadata(t) for t in meta["outputs"]])

    async def model_config(request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        config = await service.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=_model_config(config))

    async def model_infer(request: pb.ModelInferRequest,
                          context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        timeout_s = context.time_remaining()
        # Typed contents are converted element by element, raw ones checked (BOOL bytes, BYTES
        # length prefixes): off the loop when there is much of either.
        call = await off_loop_if_large(request.ByteSize(), infer_call, request, timeout_s)
        metadata = context.invocation_metadata() or ()
        call.trace = trace_fields_of_pairs(metadata)  # a traceparent, if any
        for key, value in metadata:  # asks for idempotency (gateway/idempotency.py)
            if key == IDEMPOTENCY_METADATA:
                call.idempotency_key = str(value)
                break
        return infer_response(await service.infer(call))

    async def model_statistics(request: pb.ModelStatisticsRequest,
                               context: Any) -> pb.ModelStatisticsResponse:
        stats = await service.model_statistics(request.name, request.version)
        return _statistics_response(stats["model_stats"])

    async def repository_index(request: pb.RepositoryIndexRequest,
                               context: Any) -> pb.RepositoryIndexResponse:
        rows = await service.repository_index(request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**row)
                                                  for row in rows])

    async def repository_model_load(request: pb.RepositoryModelLoadRequest,
                                    context: Any) -> pb.RepositoryModelLoadResponse:
        await service.control_model("load", request.model_name,
                                    _repository_parameters(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(request: pb.RepositoryModelUnloadRequest,
                                      context: Any) -> pb.RepositoryModelUnloadResponse:
        await service.control_model("unload", request.model_name,
                                    _repository_parameters(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    return {
        "RepositoryIndex": (repository_index, pb.RepositoryIndexRequest,
                            pb.RepositoryIndexResponse),
        "RepositoryModelLoad": (repository_model_load, pb.RepositoryModelLoadRequest,
                                pb.RepositoryModelLoadResponse),
        "RepositoryModelUnload": (repository_model_unload, pb.RepositoryModelUnloadRequest,
                                  pb.RepositoryModelUnloadResponse),
        "ModelStatistics": (model_statistics, pb.ModelStatisticsRequest,
                            pb.ModelStatisticsResponse),
        "ServerLive": (server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": (server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ModelReady": (model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": (server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": (model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelConfig": (model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelInfer": (model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
    }


async def _abort(context: grpc.aio.ServicerContext, error: GatewayError) -> NoReturn:
    """End the call with the error's gRPC code (and ``retry-after`` when it has one)."""
    trailing: tuple[tuple[str, str], ...] = ()
    if error.retry_after_s is not None:
        trailing = (("retry-after", f"{max(1, round(error.retry_after_s))}"),)
    await context.abort(getattr(grpc.StatusCode, error.grpc_code), error.message, trailing)
    raise AssertionError("unreachable: ServicerContext.abort raises")


def _unary(method: Handler) -> Handler:
    """``method`` with its errors turned into aborts. Cancellation (the client went away, or its
    deadline passed) is not caught: it reaches :meth:`Service.infer`, which revokes the request."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(request, context)
        except GatewayError as exc:
            error = exc
        except InvalidRequest as exc:
            error = GatewayError(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL, not a bare UNKNOWN
            log.exception("gRPC %s failed", getattr(method, "__name__", "call"))
            error = GatewayError(500, f"{type(exc).__name__}: {exc}")
        await _abort(context, error)

    return handler


def make_handler(service: Service) -> grpc.GenericRpcHandler:
    """The generic handler of ``inference.GRPCInferenceService`` for ``service``'s calls."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _unary(method), request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString)
        for name, (method, request_type, response_type) in {
            **_methods(service), **shared_memory_api.grpc_methods(service.shared_memory)}.items()}
    handlers["ModelStreamInfer"] = stream_infer_handler(service)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


async def start_grpc(service: Service, host: str, port: int, *,
                     max_message_bytes: int = MAX_MESSAGE_BYTES,
                     reuse_port: bool = False, max_connections: int = 0,
                     handshake_timeout_s: float = 10.0,
                     idle_timeout_s: float = 0.0) -> grpc.aio.Server:
    """Serve the gRPC front on ``host:port``; stop with ``await server.stop(grace_s)``.
    ``reuse_port``: share the port with other processes that set it (``SO_REUSEPORT``).
    ``max_connections`` (0: no cap): grpc closes a connection over it at once. A connection
    must finish its HTTP/2 handshake within ``handshake_timeout_s``; one with no call for
    ``idle_timeout_s`` (0: no limit) is closed (GOAWAY), as the REST front's idle keep-alive
    connections are.

    Raises:
        OSError: ``host:port`` cannot be bound (grpc itself raises RuntimeError).
    """
    # gRPC sets SO_REUSEPORT by default: a second gateway on a taken port would share it silently,
    # so it is off unless asked for (gateway --processes).
    options: list[tuple[str, int]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000))]
    if idle_timeout_s > 0:
        options.append(("grpc.max_connection_idle_ms", int(idle_timeout_s * 1000)))
    if max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((make_handler(service),))
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC to {host}:{port}: {exc}") from exc
    await server.start()
    return server
