"""The gRPC front's infer messages: a ModelInferRequest as the gateway's :class:`InferCall`, an
:class:`InferResult` as a ModelInferResponse (used by ModelInfer and ModelStreamInfer alike).

Inputs are checked here as the worker would check them (so that a request that breaks a rule is
never sent); data travels as the v2 binary form (``raw_input_contents``), typed ``contents``
converted to it.
"""

from __future__ import annotations

from typing import Any

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.binary import check_binary_input, check_unique_names
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.proto import inference_pb2 as pb
from asyncinfer.gateway.shared_memory import shm_reference
from asyncinfer.gateway.tensors import (
    InferCall,
    InferResult,
    InputTensor,
    RequestedOutput,
    raw_from_list,
)
from asyncinfer.wire import triton_words
from asyncinfer.wire.datatypes import spec_for
from asyncinfer.wire.envelope import printable
from asyncinfer.wire.payloads import check_shape
from asyncinfer.wire.tensor_refs import ref_of

__all__ = ["parameter_value", "set_parameter", "infer_call", "infer_response"]

#: The ``InferTensorContents`` field that holds each datatype's elements (Triton's choice);
#: FP16 and BF16 have none and travel in ``raw_input_contents`` only.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_INT64_MAX = 2**63 - 1


def parameter_value(parameter: pb.InferParameter) -> Any:
    """The plain Python value of an ``InferParameter`` (None when none of its fields is set)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def set_parameter(parameter: pb.InferParameter, value: Any) -> None:
    """Store ``value`` in the ``InferParameter`` field of its type (text for anything else)."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int) and value > _INT64_MAX:
        parameter.uint64_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def _contents_list(where: str, tensor: pb.ModelInferRequest.InferInputTensor) -> list[Any]:
    """The elements an input carries in its typed ``contents`` (the field its datatype uses).

    Raises:
        InvalidRequest: Elements in a field that is not the datatype's (or any, for FP16/BF16).
    """
    field = _CONTENTS_FIELD.get(tensor.datatype)
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
    if others:
        hint = (f"{tensor.datatype} data travels in raw_input_contents only" if field is None
                else f"{tensor.datatype} data belongs in {field}")
        raise InvalidRequest(f"{where}: has {', '.join(others)} ({hint})")
    return [] if field is None else list(getattr(tensor.contents, field))


def _inputs(request: pb.ModelInferRequest) -> list[InputTensor]:
    """The request's inputs, their data in the v2 binary form, checked as the worker would check
    them (so that a request that breaks a rule is never sent).

    Raises:
        InvalidRequest: An input without a name, or two with the same name; an unknown datatype
            or a bad shape; raw contents for some inputs only, typed contents beside raw ones,
            shared memory (not served here); raw or typed contents that do not fit the datatype
            and shape.
    """
    where_call = call_label(request.id)
    raw = request.raw_input_contents
    # an input in shared memory (or in the tensor store: parameter data_ref) has no raw contents:
    # the others' are in order (Triton's rule)
    refs = [_ref_of(where_call, t) if t.parameters else None for t in request.inputs]
    shms = [_shm_of(where_call, t) if t.parameters and refs[i] is None else None
            for i, t in enumerate(request.inputs)]
    in_message = len(shms) - sum(shm is not None or ref is not None
                                 for shm, ref in zip(shms, refs, strict=True))
    tensors, next_raw = [], 0
    for i, tensor in enumerate(request.inputs):
        if not tensor.name:
            raise InvalidRequest(f"{where_call}: input #{i} needs a name")
        name = printable(tensor.name, 100)
        where, shm = f"{where_call}: input '{name}'", shms[i]
        if refs[i] is not None:  # its data in the fleet's tensor store: passed on as it is
            if tensor.contents.ListFields():
                raise InvalidRequest(f"{where}: has both contents and 'data_ref' (give one or "
                                     f"the other)")
            spec_for(tensor.datatype, where)
            tensors.append(InputTensor(tensor.name, tensor.datatype,
                                       list(check_shape(where, list(tensor.shape))), b"",
                                       ref=refs[i]))
            continue
        if shm is None and raw and tensor.contents.ListFields():  # Triton's first check
            raise InvalidRequest(f"{triton_words.contents_and_raw(name, _model(request))} "
                                 f"({where_call}: give an input's data in one or the other)")
        if shm is None and raw and next_raw >= len(raw):
            raise InvalidRequest(f"{triton_words.no_input_data(name, _model(request))} "
                                 f"({where_call}: {len(raw)} raw_input_contents for "
                                 f"{_counted(in_message, len(shms))}; give one per input, or "
                                 f"none)")
        spec_for(tensor.datatype, where)
        shape = list(check_shape(where, list(tensor.shape)))
        if shm is not None:
            if tensor.contents.ListFields():
                raise InvalidRequest(f"{where}: has both contents and 'shared_memory_region' "
                                     f"(give one or the other)")
            tensors.append(InputTensor(tensor.name, tensor.datatype, shape, b"", shm=shm))
            continue
        if raw:
            data = raw[next_raw]
            next_raw += 1
            check_binary_input(where, tensor.datatype, shape, data)
        else:
            data = raw_from_list(where, tensor.datatype, shape, _contents_list(where, tensor))
        tensors.append(InputTensor(tensor.name, tensor.datatype, shape, data))
    if len(raw) > in_message:
        raise InvalidRequest(f"{where_call}: {len(raw)} raw_input_contents for "
                             f"{_counted(in_message, len(shms))} (give one per input, or none)")
    check_unique_names(where_call, [t.name for t in tensors])
    return tensors


def _ref_of(where_call: str, tensor: pb.ModelInferRequest.InferInputTensor) -> str | None:
    """The URL of an input's data in the tensor store (parameter ``data_ref``; None: none)."""
    if "data_ref" not in tensor.parameters:
        return None
    return ref_of({"parameters": {"data_ref": parameter_value(tensor.parameters["data_ref"])}},
                  f"{where_call}: input '{printable(tensor.name, 100)}'")


def _shm_of(where_call: str, tensor: pb.ModelInferRequest.InferInputTensor
            ) -> tuple[str, int, int] | None:
    """Where an input with parameters lies in shared memory (None: in the message)."""
    return shm_reference(f"{where_call}: input '{printable(tensor.name, 100)}'",
                         {k: parameter_value(v) for k, v in tensor.parameters.items()})


def _model(request: pb.ModelInferRequest) -> str:
    return printable(request.model_name, 100)


def _counted(in_message: int, inputs: int) -> str:
    """The inputs whose data the message holds, in words."""
    return f"{in_message} inputs" + (" not in shared memory" if in_message < inputs else "")


def infer_call(request: pb.ModelInferRequest, timeout_s: float | None) -> InferCall:
    """The :class:`InferCall` of a ModelInfer request; ``timeout_s``: the client's deadline."""
    parameters = {k: v for k, p in request.parameters.items() if (v := parameter_value(p)) is not None}
    outputs = None
    if request.outputs:
        outputs = []
        for output in request.outputs:
            at = f"{call_label(request.id)}: output '{printable(output.name, 100)}'"
            shm = (shm_reference(at, {k: parameter_value(v) for k, v in output.parameters.items()})
                   if output.parameters else None)
            outputs.append(RequestedOutput(output.name, classification=_classes(at, output),
                                           shm=shm))
    return InferCall(model=request.model_name, version=request.model_version, id=request.id,
                     inputs=_inputs(request), parameters=parameters, outputs=outputs,
                     timeout_s=timeout_s, protocol="grpc")


def _classes(at: str, output: pb.ModelInferRequest.InferRequestedOutputTensor) -> int:
    """The classes an output asks for (its ``classification`` parameter; 0: none).

    Raises:
        InvalidRequest: a parameter that is not a positive integer (Triton's gRPC front's rule).
    """
    if "classification" not in output.parameters:
        return 0
    count = parameter_value(output.parameters["classification"])
    if type(count) is not int or count <= 0:
        raise InvalidRequest(f"{at}: invalid value for 'classification' parameter, expected a "
                             f"positive int64_param (how many classes to return), got "
                             f"{count!r:.40}")
    return count


def infer_response(result: InferResult) -> pb.ModelInferResponse:
    """The ModelInferResponse of a result: every output's data in ``raw_output_contents`` (where
    tritonclient reads it), the worker's parameters (worker, device, batch_size, ...) as values."""
    response = pb.ModelInferResponse(model_name=result.model_name,
                                     model_version=result.model_version, id=result.id)
    for name, value in result.parameters.items():
        if value is not None:
            set_parameter(response.parameters[name], value)
    for output in result.outputs:  # one raw content each, empty for one in shared memory
        added = response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        if output.ref is not None:  # in the tensor store: its URL, no contents
            added.parameters["data_ref"].string_param = output.ref
        response.raw_output_contents.append(output.raw)
    return response
