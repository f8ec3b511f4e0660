"""A model's declared inputs as rules on (name, datatype, shape), in one wording: the worker's check
of a request (models/base.py) and the client's before it sends one (client/known_models.py) raise
the same :class:`~asyncinfer.errors.InvalidRequest` from here. Pure and torch-free: a producer
imports it.

The catalogue carries a model's signature (``Model.metadata``): its ``inputs`` (name, first accepted
datatype, shape with -1 for the batch dimension), ``batch_dimension``, and ``input_datatypes``
(input name → every accepted datatype), which a worker announces only for a model whose own check
refuses at least what these rules refuse: a client checks no other model (:meth:`Signature.of`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.errors import InvalidRequest

__all__ = ["InputRule", "Signature", "INPUT_DATATYPES", "check_missing", "check_declared",
           "check_tensor"]

#: The catalogue key (model-level) listing each declared input's accepted datatypes.
INPUT_DATATYPES = "input_datatypes"


def check_missing(request_id: str, model: str, declared: Iterable[str], given: Iterable[str],
                  what: str = "model") -> None:
    """Raise InvalidRequest when an input of ``declared`` is not among ``given``; ``what`` names
    whose inputs they are (``"model"``, ``"forward stage of model"``)."""
    names = set(given)
    missing = [n for n in declared if n not in names]
    if missing:
        raise InvalidRequest(
            f"request {request_id}: {what} '{model}' needs input(s) "
            f"{', '.join(repr(m) for m in missing)}; got {', '.join(repr(g) for g in sorted(names))}")


def check_declared(request_id: str, model: str, declared: Collection[str], name: str,
                   what: str = "model") -> None:
    """Raise InvalidRequest when input ``name`` is not among ``declared``."""
    if name not in declared:
        raise InvalidRequest(
            f"request {request_id}: input '{name}' is not an input of {what} "
            f"'{model}' (inputs: {', '.join(repr(n) for n in declared)})")


def check_tensor(request_id: str, name: str, datatype: str, shape: Sequence[int],
                 datatypes: Sequence[str], row_shape: Sequence[int],
                 batch_dimension: bool = True) -> None:
    """Raise InvalidRequest when input ``name`` of ``datatype`` and ``shape`` does not fit: its
    datatype not among ``datatypes``, or its row (``shape`` without the first dimension; without
    ``batch_dimension``, the whole shape) not of ``row_shape`` (-1: any size)."""
    if datatype not in datatypes:
        raise InvalidRequest(
            f"request {request_id}: input '{name}': datatype {datatype} is not accepted "
            f"(accepted: {', '.join(datatypes)})")
    row = tuple(shape[1:] if batch_dimension else shape)
    want = tuple(row_shape)
    fits = row == want or len(row) == len(want) and all(
        w in (-1, got) for w, got in zip(want, row, strict=True))
    if not fits:
        wanted = (["n"] if batch_dimension else []) + ["any" if d == -1 else str(d) for d in want]
        raise InvalidRequest(
            f"request {request_id}: input '{name}': shape {list(shape)} does not match "
            f"[{', '.join(wanted)}]")


@dataclass(frozen=True)
class InputRule:
    """One declared input as a client sees it: its accepted datatypes and the shape of one row."""

    datatypes: tuple[str, ...]
    row_shape: tuple[int, ...]


@dataclass(frozen=True)
class Signature:
    """A model's declared inputs (in declaration order) and whether they have a batch dimension."""

    model: str
    inputs: Mapping[str, InputRule]
    batch_dimension: bool = True
    #: Input name → (accepted datatypes, rank, (index, size) of each fixed dimension): what
    #: :meth:`fits` compares, made once.
    _quick: dict[str, tuple[frozenset[str], int, tuple[tuple[int, int], ...]]] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = 1 if self.batch_dimension else 0
        object.__setattr__(self, "_quick", {
            name: (frozenset(rule.datatypes), len(rule.row_shape) + first,
                   tuple((i + first, d) for i, d in enumerate(rule.row_shape) if d != -1))
            for name, rule in self.inputs.items()})

    @classmethod
    def of(cls, model: str, metadata: Mapping[str, Any]) -> Signature | None:
        """The signature a catalogue entry's ``metadata`` announces; None when it announces none
        to check by: no inputs (any are accepted), no ``input_datatypes`` (a worker from before
        them, or a model with a check of its own), or anything not of the expected form."""
        try:
            return cls._of(model, metadata)
        except (TypeError, ValueError, KeyError, AttributeError):
            return None

    @classmethod
    def _of(cls, model: str, metadata: Mapping[str, Any]) -> Signature | None:
        accepted = metadata.get(INPUT_DATATYPES)
        tensors = metadata.get("inputs")
        batched = metadata.get("batch_dimension", True)
        if not isinstance(accepted, Mapping) or not tensors or not isinstance(batched, bool):
            return None
        inputs: dict[str, InputRule] = {}
        for tensor in tensors:
            name, shape = tensor["name"], tensor["shape"]
            datatypes = accepted[name]
            if (not isinstance(name, str) or name in inputs or not isinstance(datatypes, list)
                    or not datatypes or not all(isinstance(d, str) for d in datatypes)
                    or not isinstance(shape, list) or not all(type(d) is int for d in shape)):
                return None
            if batched and (not shape or shape[0] != -1):
                return None
            inputs[name] = InputRule(tuple(datatypes), tuple(shape[1:] if batched else shape))
        if set(accepted) != set(inputs):
            return None
        return cls(model, inputs, batched)

    def fits(self, items: Any) -> bool:
        """Whether the v2 input dicts ``items`` surely fit: every declared input once, each of an
        accepted datatype and row shape (the quick path of every good request; False: see
        :meth:`first_refusal`)."""
        quick = self._quick
        try:
            if len(items) != len(quick):
                return False
            for item in items:
                rule = quick.get(item["name"])
                if rule is None:
                    return False
                datatypes, rank, fixed = rule
                shape = item["shape"]
                if item["datatype"] not in datatypes or len(shape) != rank:
                    return False
                for index, size in fixed:
                    if shape[index] != size:
                        return False
            return len(items) == 1 or len({item["name"] for item in items}) == len(items)
        except (TypeError, KeyError, AttributeError, IndexError):
            return False

    def first_refusal(self, request_id: str,
                      tensors: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[int, InvalidRequest] | None:
        """Where a request of these (name, datatype, shape) ``tensors`` breaks the signature, in
        the worker's order (missing inputs, then each input in request order: not declared, then
        datatype and shape): the index of the input that breaks it (-1: inputs missing) and the
        error; None when it fits."""
        try:
            check_missing(request_id, self.model, self.inputs, (t[0] for t in tensors))
        except InvalidRequest as exc:
            return -1, exc
        for index, (name, datatype, shape) in enumerate(tensors):
            try:
                check_declared(request_id, self.model, self.inputs, name)
                rule = self.inputs[name]
                check_tensor(request_id, name, datatype, shape, rule.datatypes, rule.row_shape,
                             self.batch_dimension)
            except InvalidRequest as exc:
                return index, exc
        return None
