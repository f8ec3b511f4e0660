"""What a model file's program takes and gives, read from the program itself.

A ``torch.export`` program's graph says each user input's name (the forward's argument names),
datatype and shape, and each output's: the first dimension is the batch dimension, any other
dynamic (symbolic) size is -1. Its outputs are named as :class:`~asyncinfer.models.files.FileModel`
names a program's results: ``output`` for one tensor, ``output_0``, ``output_1``, … for a tuple or
list, a dict's keys. A program exported for a range of batch sizes (``Dim("batch", min=2,
max=64)``), or for one (a static first dimension), has its :class:`BatchRange`: the rows one call
takes, which the file model keeps to by splitting and padding a batch.

A TorchScript forward's schema says only its arguments' names: each is an :class:`AnyShape` input
(any numeric datatype, any shape), so a request's names and count are checked, nothing more, and
no warm-up or graph is built for it (there is no example to build).

A program these rules cannot describe (an input that is not a tensor, nested or keyword inputs, a
scalar input without a batch dimension, a dtype no v2 datatype holds) gets no signature; ``why``
says what stopped it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from asyncinfer.models.base import InputSpec, OutputSpec
from asyncinfer.wire.tensors import TORCH_DTYPES

__all__ = ["AnyShape", "BatchRange", "ProgramSignature", "NUMERIC_DATATYPES",
           "exported_signature", "script_signature"]

#: What a TorchScript argument accepts: every datatype a torch tensor holds (BYTES is not one),
#: FP32 first (what the metadata shows).
NUMERIC_DATATYPES = ("FP32", *(d for d in TORCH_DTYPES if d != "FP32"))
_DATATYPE_OF = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class AnyShape(InputSpec):
    """An input whose rows may have any shape: a TorchScript argument, whose file says neither
    shape nor datatype. Only its datatype is checked (a datatype of :attr:`datatypes`);
    :attr:`row_shape` is what the metadata shows. A model with such an input is not warmed up
    and gets no graphs (engine/warmup.py, engine/graphs.py): no example of it can be built."""

    def check(self, request_id: str, name: str, datatype: str, shape: tuple[int, ...],
              batch_dimension: bool = True) -> None:
        fitting = (*tuple(shape)[:1], *self.row_shape) if batch_dimension else self.row_shape
        super().check(request_id, name, datatype, fitting, batch_dimension)


@dataclass(frozen=True)
class BatchRange:
    """The rows one call of an exported program takes: ``low`` to ``high`` (None: no limit)."""

    low: int
    high: int | None

    def fits(self, rows: int) -> bool:
        """Whether one call takes ``rows`` rows."""
        return self.low <= rows and (self.high is None or rows <= self.high)

    def pieces(self, rows: int) -> list[tuple[int, int]]:
        """``rows`` rows as (start, stop) pieces of at most ``high`` rows each, in order (one
        piece below ``low`` is padded by the caller)."""
        step = self.high or rows
        if rows <= step:
            return [(0, rows)]
        return [(start, min(start + step, rows)) for start in range(0, rows, step)]


@dataclass(frozen=True)
class ProgramSignature:
    """A program's inputs and outputs (None: not known), how many arguments its forward takes
    (least, most; None: not known), its batch range (None: any rows in one call), and why it has
    no inputs when it has none."""

    inputs: dict[str, InputSpec] | None
    outputs: dict[str, OutputSpec] | None = None
    arguments: tuple[int, int] | None = None
    batch: BatchRange | None = None
    why: str = ""


def exported_signature(program: Any, batch_dimension: bool = True) -> ProgramSignature:
    """The signature of a ``torch.export.ExportedProgram`` (see the module); without
    ``batch_dimension`` (Triton's ``max_batch_size: 0``) its row shapes are whole shapes, and it
    has no batch range."""
    graph = program.graph_signature
    nodes = {node.name: node for node in program.graph.nodes}
    user = [s for s in graph.input_specs if s.kind == InputKind.USER_INPUT]
    for spec in user:
        if not isinstance(spec.arg, TensorArgument):
            return ProgramSignature(None, why=f"its argument {spec.arg.name!r} is not a tensor")
    args, kwargs = program.call_spec.in_spec.children()
    if (args.type not in (tuple, list) or args.num_children != len(user) or kwargs.num_children
            or not all(child.is_leaf() for child in args.children())):
        return ProgramSignature(None, why="its inputs are not a flat list of tensors")
    names = _argument_names(program, [spec.arg.name for spec in user])
    values = [nodes[spec.arg.name].meta.get("val") for spec in user]
    inputs: dict[str, InputSpec] = {}
    for name, value in zip(names, values, strict=True):
        datatype = _DATATYPE_OF.get(getattr(value, "dtype", None))  # type: ignore[arg-type]
        if datatype is None or not isinstance(value, torch.Tensor):
            return ProgramSignature(None, why=f"its input {name!r} is of a dtype no v2 datatype "
                                              f"holds ({getattr(value, 'dtype', value)})")
        if value.dim() == 0 and batch_dimension:
            return ProgramSignature(None, why=f"its input {name!r} is a scalar: it has no batch "
                                              f"dimension")
        inputs[name] = InputSpec((datatype,), _row_shape(value, batch_dimension))
    outputs = _outputs(program, nodes, batch_dimension)
    batch = _batch_range(program, values, outputs[1] if outputs else None) if batch_dimension \
        else None
    return ProgramSignature(inputs, outputs[0] if outputs else None, (len(inputs), len(inputs)),
                            batch)


def script_signature(program: Any) -> ProgramSignature:
    """The signature of a TorchScript module: its forward's leading tensor arguments, each an
    :class:`AnyShape` input; none when a later argument is neither a tensor nor has a default."""
    arguments = list(program.forward.schema.arguments)[1:]  # the first is self
    names: list[str] = []
    for index, argument in enumerate(arguments):
        if isinstance(argument.type, torch.TensorType) and index == len(names):
            names.append(argument.name)
        elif argument.default_value is None and not isinstance(argument.type, torch.OptionalType):
            return ProgramSignature(None, why=f"its argument {argument.name!r} ({argument.type}) "
                                              f"is not a tensor and has no default")
    if not names:
        return ProgramSignature(None, why="its forward takes no tensor")
    inputs: dict[str, InputSpec] = {n: AnyShape(NUMERIC_DATATYPES, ()) for n in names}
    return ProgramSignature(inputs, None, (len(names), len(arguments)))


def _argument_names(program: Any, placeholders: list[str]) -> list[str]:
    """The forward's argument names (the placeholders' names when the program does not keep
    them)."""
    calls = getattr(program, "module_call_graph", None) or []
    signature = calls[0].signature if calls else None
    names = list(getattr(signature, "forward_arg_names", None) or [])
    return names if len(names) == len(placeholders) else placeholders


def _row_shape(value: torch.Tensor, batch_dimension: bool = True) -> tuple[int, ...]:
    """A tensor's shape past its first dimension (its whole shape without ``batch_dimension``),
    a dynamic (symbolic) size as -1."""
    shape = value.shape[1:] if batch_dimension else value.shape
    return tuple(d if isinstance(d, int) else -1 for d in shape)


def _outputs(program: Any, nodes: dict[str, Any], batch_dimension: bool
             ) -> tuple[dict[str, OutputSpec], list[torch.Tensor]] | None:
    """The declared outputs and their (fake) tensors; None when they cannot be named or typed."""
    user = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    spec = program.call_spec.out_spec
    names: list[str]
    if spec.is_leaf():
        names = ["output"]
    elif spec.type in (tuple, list) and all(c.is_leaf() for c in spec.children()):
        names = [f"output_{i}" for i in range(spec.num_children)]
    elif spec.type is dict and all(c.is_leaf() for c in spec.children()):
        names = [str(key) for key in spec.context]
    else:
        return None
    if len(names) != len(user) or not all(isinstance(s.arg, TensorArgument) for s in user):
        return None
    values = [nodes[s.arg.name].meta.get("val") if s.arg.name in nodes else None for s in user]
    outputs: dict[str, OutputSpec] = {}
    tensors: list[torch.Tensor] = []
    for name, value in zip(names, values, strict=True):
        datatype = _DATATYPE_OF.get(getattr(value, "dtype", None))  # type: ignore[arg-type]
        if datatype is None or not isinstance(value, torch.Tensor):
            return None
        outputs[name] = OutputSpec(datatype, _row_shape(value, batch_dimension))
        tensors.append(value)
    return outputs, tensors


def _batch_range(program: Any, inputs: list[torch.Tensor],
                 outputs: list[torch.Tensor] | None) -> BatchRange | None:
    """The rows one call takes, from the inputs' first dimensions; None when any number does, or
    when it cannot be kept to (an output whose first dimension is not the batch's)."""
    low, high = 0, None  # high None: no limit
    symbols: set[Any] = set()
    for value in inputs:
        first = value.shape[0]
        if isinstance(first, int):
            bounds: tuple[int, int | None] = (first, first)
        else:
            symbol = first.node.expr
            ranged = program.range_constraints.get(symbol)
            if ranged is None:
                return None
            symbols.add(symbol)
            bounds = (int(ranged.lower), _finite(ranged.upper))
        low = max(low, bounds[0])
        high = bounds[1] if high is None else high if bounds[1] is None else min(high, bounds[1])
    if (high is not None and high < max(low, 1)) or (low <= 1 and high is None):
        return None
    if outputs is None:
        return None
    for value in outputs:
        rows: Any = value.shape[0] if value.dim() else None
        batch_first = (isinstance(rows, int) and low == high == rows) or (
            rows is not None and not isinstance(rows, int) and rows.node.expr in symbols)
        if not batch_first:
            return None
    return BatchRange(low, high)


def _finite(bound: Any) -> int | None:
    """A range's upper bound as an int; None for torch's unbounded (``int_oo``)."""
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
