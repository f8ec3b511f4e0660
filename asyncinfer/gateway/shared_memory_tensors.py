"""A call's tensors in system shared memory (gateway/shared_memory.py): its inputs read from their
regions before it is sent, checked as data in the request would be; its outputs written to their
regions after the answer, and left out of the response (HTTP: no data; gRPC: an empty raw
content, as Triton answers)."""

from __future__ import annotations

from dataclasses import replace

from asyncinfer.gateway.binary import check_binary_input
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.shared_memory import SharedMemory
from asyncinfer.gateway.tensors import InferCall, OutputTensor
from asyncinfer.wire.envelope import printable

__all__ = ["in_shared_memory", "read_inputs", "write_outputs", "refuse_streamed_outputs",
           "input_bytes"]


def in_shared_memory(call: InferCall) -> bool:
    """Whether any input or requested output of ``call`` lies in a shared-memory region."""
    return (any(t.shm is not None for t in call.inputs)
            or any(o.shm is not None for o in call.outputs or ()))


def input_bytes(call: InferCall) -> int:
    """How many bytes ``call``'s inputs in shared memory hold (to read them off the loop)."""
    return sum(t.shm[2] for t in call.inputs if t.shm is not None)


def read_inputs(regions: SharedMemory, call: InferCall) -> None:
    """Read each input of ``call`` that lies in a region into its ``raw``, and check it against
    its datatype and shape (a size that does not fit is refused as binary data would be); check
    that each output it wants in a region has its place there (before it runs, not after)."""
    for output in call.outputs or ():
        if output.shm is not None:
            regions.check(f"{call_label(call.id)}: output '{printable(output.name, 100)}'",
                          *output.shm)
    for tensor in call.inputs:
        if tensor.shm is None:
            continue
        at = f"{call_label(call.id)}: input '{printable(tensor.name, 100)}'"
        region, offset, byte_size = tensor.shm
        tensor.raw = regions.read(at, region, offset, byte_size)
        check_binary_input(at, tensor.datatype, tensor.shape, tensor.raw)


def write_outputs(regions: SharedMemory, call: InferCall,
                  outputs: list[OutputTensor]) -> list[OutputTensor]:
    """``outputs``, each one the call asked for in a region written there and left empty."""
    wanted = {o.name: o.shm for o in call.outputs or () if o.shm is not None}
    done = []
    for output in outputs:
        shm = wanted.get(output.name)
        if shm is None:
            done.append(output)
            continue
        at = f"{call_label(call.id)}: output '{printable(output.name, 100)}'"
        region, offset, byte_size = shm
        regions.write(at, region, offset, byte_size, output.raw)
        done.append(replace(output, raw=b"", shm=shm))
    return done


def refuse_streamed_outputs(call: InferCall) -> None:
    """A streamed (decoupled) call's parts cannot share one output region: refused by name."""
    for output in call.outputs or ():
        if output.shm is not None:
            raise GatewayError(400, f"{call_label(call.id)}: output "
                                    f"'{printable(output.name, 100)}': shared memory is not "
                                    f"served for the parts of a streamed response (each part "
                                    f"would overwrite the last); take the parts in the "
                                    f"response")
