"""What a model is to the worker: declared inputs, a batched forward, and its own checks."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest
from asyncinfer.models.sequence import SequenceBatching
from asyncinfer.wire.protocol import Request
from asyncinfer.wire.signature import INPUT_DATATYPES, check_declared, check_missing, check_tensor

__all__ = ["InputSpec", "OutputSpec", "Model", "Batch", "StreamStep", "StreamRows"]

#: A batch on its way through a model: input name → tensor (numpy object array for BYTES).
Batch = dict[str, Any]

#: An input's layout as Triton's model config names it (``ModelInput.format``): none, or an image's
#: channels last (NHWC) or first (NCHW).
INPUT_FORMATS = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")


@dataclass(frozen=True)
class InputSpec:
    """One declared input: its accepted datatypes, the shape of one row (-1: any size), whether
    NaN and infinite values are accepted (``allow_nonfinite=False`` refuses them), and its
    ``format`` as Triton's model config gives it (``"NCHW"`` or ``"NHWC"`` for an image, Triton's
    ``FORMAT_*`` names too; "" for none): clients such as Triton's image client read it from the
    model config to lay out what they send. It changes no check: a model says it, the gateway
    shows it."""

    datatypes: tuple[str, ...]
    row_shape: tuple[int, ...]
    allow_nonfinite: bool = True
    format: str = ""

    def __post_init__(self) -> None:
        named = self.format.upper()
        named = named if not named or named.startswith("FORMAT_") else f"FORMAT_{named}"
        if named and named not in INPUT_FORMATS:
            raise ValueError(f"InputSpec: format must be NCHW, NHWC or NONE (Triton's "
                             f"{', '.join(INPUT_FORMATS)}), got {self.format!r}")
        object.__setattr__(self, "format", "" if named == "FORMAT_NONE" else named)

    def check(self, request_id: str, name: str, datatype: str, shape: tuple[int, ...],
              batch_dimension: bool = True) -> None:
        """Raise InvalidRequest when an input of this datatype and shape does not fit (without
        ``batch_dimension``, :attr:`row_shape` is the input's whole shape: Triton's
        ``max_batch_size: 0``)."""
        check_tensor(request_id, name, datatype, shape, self.datatypes, self.row_shape,
                     batch_dimension)

    def check_values(self, request_id: str, name: str, value: Any) -> None:
        """Raise InvalidRequest when ``value`` holds NaN or infinity and this input refuses them."""
        if self.allow_nonfinite or not isinstance(value, torch.Tensor):
            return
        if not (value.is_floating_point() or value.is_complex()):
            return
        finite = torch.isfinite(value)
        if bool(finite.all()):
            return
        first = int((~finite).reshape(-1).nonzero()[0, 0])
        bad = value.reshape(-1)[first].item()
        raise InvalidRequest(
            f"request {request_id}: input '{name}': NaN and infinite values are not accepted "
            f"(element {first} is {bad})")


@dataclass(frozen=True)
class OutputSpec:
    """One declared output: its datatype, the shape of one row (-1: any size), and the labels of
    its classes (index → label, as the lines of Triton's ``label_filename``; empty for none): the
    gateway's classification extension answers ``"value:index:label"`` with them."""

    datatype: str
    row_shape: tuple[int, ...]
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        labels = tuple(self.labels)
        if not all(isinstance(label, str) and "\n" not in label for label in labels):
            raise ValueError("OutputSpec labels must be strings without line breaks")
        object.__setattr__(self, "labels", labels)


@dataclass
class StreamStep:
    """One step of a decoupled model (:meth:`Model.stream`): outputs for some rows of its batch.

    ``rows`` are indices into the batch (0 … n-1, each a request: a streaming request holds one
    row); every output in ``outputs`` has ``len(rows)`` rows, in that order. ``done`` are the rows
    that finished with this step: no more steps are asked of them (a row may finish without
    outputs in its last step). A row in neither keeps going.
    """

    rows: Sequence[int]
    outputs: Batch
    done: Sequence[int] = ()


@dataclass
class StreamRows:
    """Which rows of a streaming batch are still wanted, as the runner sees it between steps
    (a row's request revoked, expired or past its time limit is cancelled). A model's
    :meth:`Model.stream` should stop computing a cancelled row at its next step (the runner
    drops its outputs either way).

    In-flight batching (:attr:`Model.inflight_batching`): between steps the runner may add rows
    (:meth:`join`: new requests, their inputs preprocessed and on the device); ``size`` grows
    and the new rows are live at once. The model absorbs them with :meth:`take_joined` at the
    top of each step, before it computes the live rows; both run on the device thread, between
    two steps, never during one."""

    size: int
    cancelled: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    #: Rows joined since the model last took them: (their row indices, their inputs).
    _joined: list[tuple[list[int], Batch]] = field(default_factory=list, repr=False)

    def join(self, inputs: Batch) -> list[int]:
        """The runner adds the rows of ``inputs`` (one per request; every input has the same
        number of rows, first dimension) after the last row; returns their indices."""
        counts = {name: _rows_in(value) for name, value in inputs.items()}
        if not counts or len(set(counts.values())) != 1 or min(counts.values()) < 1:
            raise ValueError(f"rows to join need inputs of one number (>= 1) of rows each, "
                             f"got {counts}")
        added = list(range(self.size, self.size + next(iter(counts.values()))))
        self.size += len(added)
        self._joined.append((added, inputs))
        return added

    def take_joined(self) -> list[tuple[list[int], Batch]]:
        """The model's side of :meth:`join`: the rows joined since the last call, in the order
        they joined, each group as (its row indices, its inputs: row ``i`` of the inputs is row
        ``indices[i]`` of the batch); empty when none joined."""
        joined, self._joined = self._joined, []
        return joined

    def is_live(self, row: int) -> bool:
        """Whether ``row`` is neither finished nor cancelled."""
        return row not in self.cancelled and row not in self.finished

    def live(self) -> list[int]:
        """The rows still running, in order."""
        return [r for r in range(self.size) if self.is_live(r)]


def _rows_in(value: Any) -> int:
    """The number of rows (first dimension) of an input: a tensor or a numpy array."""
    shape: tuple[int, ...] = tuple(getattr(value, "shape", ()))
    return int(shape[0]) if shape else -1


def _tensor_metadata(name: str, datatype: str, row_shape: tuple[int, ...],
                     labels: tuple[str, ...] = (), batch_dimension: bool = True,
                     layout: str = "") -> dict[str, Any]:
    """A tensor as the catalogue holds it: its shape with -1 for the batch dimension (none
    without one), its labels and ``format`` (Triton's ``FORMAT_*``) only when declared."""
    tensor: dict[str, Any] = {"name": name, "datatype": datatype,
                              "shape": [-1, *row_shape] if batch_dimension else list(row_shape)}
    if layout:
        tensor["format"] = layout
    return {**tensor, "labels": list(labels)} if labels else tensor


class Model:
    """Base of every model the worker hosts.

    Subclasses set :attr:`inputs` (None accepts any input) and implement :meth:`forward`, which
    gets whole batches: the first dimension of every input is the rows of many requests together.
    A batch goes through three stages, each overlapping the others' work on other batches:
    :meth:`preprocess` (CPU), :meth:`forward` (on the device's stream) and :meth:`postprocess`
    (CPU, after the results are on the host).
    """

    name: str = ""
    #: Whether rows of different requests may run in one forward call.
    batchable: bool = True
    #: Whether the first dimension of every input is the batch's rows (Triton's
    #: ``max_batch_size`` above 0). False is Triton's ``max_batch_size: 0``: the inputs have no
    #: batch dimension — an :class:`InputSpec`'s ``row_shape`` (and an :class:`OutputSpec`'s) is
    #: then the tensor's whole shape, and inputs may differ in their first dimension — and each
    #: request runs alone, its tensors as sent to :meth:`forward` (or :meth:`stream`), its outputs
    #: returned as the model made them (a decoupled model's step outputs: one part each).
    batch_dimension: bool = True
    #: Declared inputs; None means any names, datatypes and shapes.
    inputs: Mapping[str, InputSpec] | None = None
    #: Whether :meth:`validate` refuses at least what the declared :attr:`inputs` refuse (names,
    #: datatypes, shapes), as Model's own does: a client may then refuse such a request before it
    #: sends it (the catalogue lists each input's accepted datatypes, ``input_datatypes``:
    #: wire/signature.py). None (the default): whether :meth:`validate` is Model's own; a model
    #: whose :meth:`validate` calls Model's first and only adds refusals may say True.
    client_checks_inputs: bool | None = None
    #: Declared inputs of :meth:`forward` for a model with its own :meth:`preprocess` (what the
    #: forward stage of the cross-worker pipeline accepts); None: that model serves no forward stage.
    forward_inputs: Mapping[str, InputSpec] | None = None
    #: Default batching options; configuration (ASYNCINFER_MODEL_OPTIONS) overrides them.
    options: ModelOptions = ModelOptions()
    #: Declared outputs (for the model catalogue and v2 model metadata); None: not declared.
    outputs: Mapping[str, OutputSpec] | None = None
    #: The version the catalogue announces (v2 ``versions``).
    version: str = "1"
    #: The v2 ``platform`` of its metadata.
    platform: str = "pytorch"
    #: Whether it answers in steps (:meth:`stream`): Triton's decoupled transaction policy. Its
    #: requests hold one row each; each step's outputs go to the request's stream
    #: (wire/stream.py) and its one answer is the parts joined (:meth:`join_parts`).
    decoupled: bool = False
    #: A decoupled model only: whether requests that arrive while a batch streams join it
    #: between two steps (in-flight, or continuous, batching: TensorRT-LLM's
    #: ``batching_strategy: inflight_fused_batching``, vLLM's continuous batching). Its
    #: :meth:`stream` then takes the joined rows (:meth:`StreamRows.take_joined`) at the top of
    #: each step; without it (the default) a batch is the requests it started with, and
    #: requests arriving meanwhile wait until every row of it finished.
    inflight_batching: bool = False
    #: A stateful model (Triton's sequence batcher, Oldest strategy: models/sequence.py): every
    #: request belongs to a sequence (parameter ``sequence_id``, with ``sequence_start`` on its
    #: first request and ``sequence_end`` on its last) and holds one row; a sequence's requests
    #: run in order on one worker, one at a time, and :meth:`forward` gets the control inputs
    #: (START, END, READY, CORRID) and the sequence's state that this declares. None: stateless.
    sequence_batching: SequenceBatching | None = None

    def metadata(self, options: ModelOptions) -> dict[str, Any]:
        """What the worker announces in the model catalogue: the v2 model metadata (inputs and
        outputs with -1 for the batch dimension, an input's ``format`` when it declares one; none
        for a model that declares none), the
        batching it serves with (``max_batch_size``; Triton's ``dynamic_batching`` and
        ``instance_group`` count), and whether it streams its answers (``decoupled``: Triton's
        ``model_transaction_policy``); with :attr:`client_checks_inputs`, every datatype each
        input accepts (``input_datatypes``: a client checks a request against them before it
        sends it; ``inputs`` name the first only)."""
        batched = self.batch_dimension
        inputs = [_tensor_metadata(n, s.datatypes[0], s.row_shape, batch_dimension=batched,
                                   layout=s.format)
                  for n, s in (self.inputs or {}).items()]
        outputs = [_tensor_metadata(n, s.datatype, s.row_shape, s.labels, batched)
                   for n, s in (self.outputs or {}).items()]
        entry = {"name": self.name, "versions": [self.version], "platform": self.platform,
                 "inputs": inputs, "outputs": outputs,
                 "max_batch_size": options.max_batch_size if batched else 0,
                 "batchable": self.batchable and batched, "batch_dimension": batched,
                 "decoupled": self.decoupled}
        if self.sequence_batching is not None:
            entry["sequence_batching"] = self.sequence_batching.config()
        if entry["batchable"]:  # Triton's dynamic_batching, as the batcher serves it
            entry["dynamic_batching"] = {
                "preferred_batch_size": list(options.preferred_batch_sizes),
                "max_queue_delay_microseconds": round(options.max_delay_ms * 1000)}
        entry["instance_group"] = [{"count": options.instances}]
        checked = self.client_checks_inputs
        if checked is None:
            checked = type(self).validate is Model.validate
        if self.inputs and checked:
            entry[INPUT_DATATYPES] = {n: list(s.datatypes) for n, s in self.inputs.items()}
        return entry

    def load(self, device: torch.device) -> None:
        """Move weights to ``device``; called once in the worker process before serving."""

    def end_sequence(self, sequence_id: int | str) -> None:
        """(A stateful model.) The worker released sequence ``sequence_id``'s state: it ended, was
        idle past its timeout, or the model is unloaded. A model that keeps state of its own per
        correlation ID (Triton's Oldest contract) drops it here. Default: nothing (the runner's
        implicit state, :class:`SequenceState`, is released by the runner)."""

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest when ``request`` does not fit the declared inputs."""
        if self.inputs is not None:
            _check_inputs(request, self.name, self.inputs, "model", self.batch_dimension)

    def validate_forward(self, request: Request) -> None:
        """Raise InvalidRequest when a request for the forward stage alone (already preprocessed)
        does not fit what :meth:`forward` accepts.

        A model without its own :meth:`preprocess` gets its inputs unchanged, so the forward stage
        checks them as :meth:`validate` does. A model with one checks :attr:`forward_inputs` and
        refuses the stage when it declares none: the marker asking for the forward stage is a
        request parameter any producer can set, so it never switches the checks off.
        """
        if type(self).preprocess is Model.preprocess:
            self.validate(request)
            return
        if self.forward_inputs is None:
            raise InvalidRequest(
                f"request {request.id}: model '{self.name}' declares no forward_inputs, so it does not "
                f"serve the forward stage alone; send the request without parameters.stage")
        _check_inputs(request, self.name, self.forward_inputs, "forward stage of model",
                      self.batch_dimension)

    def signature(self, request: Request) -> Hashable:
        """Requests with equal signatures may share a batch (default: same names, datatypes and
        row shapes; a model that pads variable lengths can relax it)."""
        return tuple((t.name, t.datatype, t.shape[1:]) for t in request.inputs)

    def row_cost(self, request: Request) -> float | None:
        """What one row of ``request`` costs the device, in any unit of the model's (MiniLM: its
        length), so that rows of similar cost share batches (a batch runs padded to its longest
        row: ``ModelOptions.group_by_cost``). Called once per request, on the request's path:
        keep it cheap. None (the default): rows cost alike; batches form in arrival order."""
        return None

    def collate(self, name: str, values: list[Any]) -> Any:
        """Join the values of input ``name`` of several requests along the first dimension."""
        if isinstance(values[0], np.ndarray):
            return np.concatenate(values)
        return torch.cat(values)

    def compile(self, mode: str, device: torch.device) -> bool:
        """Compile :meth:`forward` as ``mode`` asks (``"torchscript"``), after :meth:`load`, and
        check it against eager; True when the compiled forward is now used. Default: False
        (runs eager). See engine/compile.py."""
        return False

    def preprocess(self, batch: Batch) -> Batch:
        """CPU work on a whole batch before the device (tokenization, say). Default: none."""
        return batch

    def forward(self, batch: Batch) -> Batch:
        """Run one batch on the device; return output name → tensor with the same rows."""
        raise NotImplementedError

    def postprocess(self, outputs: Batch) -> Batch:
        """CPU work on a batch's outputs once they are on the host (pooling, say). Default: none."""
        return outputs

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        """A decoupled model's steps over a whole batch (on the device's stream, like
        :meth:`forward`): each step computes every live row at once and yields a
        :class:`StreamStep` for the rows it produced outputs for; rows finish at different
        steps. ``rows`` tells which rows are still wanted (see :class:`StreamRows`). The runner
        closes the generator when every row is finished or cancelled (and, with
        :attr:`inflight_batching`, no request waits to join). With :attr:`inflight_batching`,
        call ``rows.take_joined()`` at the top of each step and compute the joined rows from
        that step on; a generator that ends leaves its live rows finished as they are."""
        raise NotImplementedError

    def join_parts(self, name: str, parts: list[Any]) -> Any:
        """A streaming request's one answer for output ``name`` from its parts (each with the
        request's one row first). Default: joined along the second dimension (a part of shape
        [1, k] each: [1, sum of k]); parts of one dimension are stacked ([1] each: [1, parts])."""
        if not parts:
            raise ValueError(f"output '{name}': no parts to join")
        if isinstance(parts[0], np.ndarray):
            return (np.concatenate(parts, axis=1) if parts[0].ndim >= 2
                    else np.stack(parts, axis=1))
        return torch.cat(parts, dim=1) if parts[0].dim() >= 2 else torch.stack(parts, dim=1)


def _check_inputs(request: Request, model: str, specs: Mapping[str, InputSpec], what: str,
                  batch_dimension: bool = True) -> None:
    """Raise InvalidRequest unless ``request`` has exactly the inputs ``specs`` declare, each fitting
    its spec (datatype, row shape, NaN/Inf); ``what`` names whose inputs they are in the error."""
    check_missing(request.id, model, specs, (t.name for t in request.inputs), what)
    for t in request.inputs:
        check_declared(request.id, model, specs, t.name, what)
        spec = specs[t.name]
        spec.check(request.id, t.name, t.datatype, t.shape, batch_dimension)
        spec.check_values(request.id, t.name, t.value)
