"""Models loaded from files: TorchScript (``NAME.pt``) and ``torch.export`` programs (``NAME.pt2``).

A file model has a signature: its inputs and outputs as given (a model repository's
``config.pbtxt``), else as its program says (models/program_signature.py): an exported program's
inputs by name, datatype and shape, a TorchScript forward's arguments by name. A request names its
inputs as declared, in any order, and :meth:`Model.validate` refuses one that does not fit
(InvalidRequest: HTTP 400); the program gets them by position, in the declared order (as Triton's
libtorch backend maps inputs to arguments). A program with no signature (see that module) gets
the inputs in the order the request lists them, whatever their names. A single tensor result is
the output ``output`` (the first declared output), a tuple or list gives ``output_0``,
``output_1``, … (the declared outputs, in order), a dict its keys.

An exported program made for a range of batch sizes, or for one, gets each batch in pieces it
takes: at most its largest batch at a time, a smaller piece padded with zero rows to its
smallest (the padding's outputs dropped), so requests batch as any model's do.

Nothing in a model file is unpickled beyond tensors. TorchScript's own reader rebuilds only tensors
and TorchScript types (an archive naming any other Python global is refused by torch). An exported
program's archive is another matter: ``torch.export.load`` unpickles its pickled Python objects,
and retries a failed weights-only load of its example inputs with the full unpickler — a crafted
``.pt2`` would run code when the worker loads it. So an archive holding pickled objects is refused,
and the rest is loaded with every ``torch.load`` forced to torch's weights-only unpickler.
"""

from __future__ import annotations

import logging
import os
import threading
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec
from asyncinfer.models.program_signature import (
    AnyShape,
    BatchRange,
    ProgramSignature,
    exported_signature,
    script_signature,
)

__all__ = ["FileModel", "FILE_SUFFIXES", "load_exported", "file_kind_refusal"]

FILE_SUFFIXES = (".pt", ".pt2")

log = logging.getLogger(__name__)


class FileModel(Model):
    """A TorchScript or exported program read from ``path`` when the worker loads it.

    ``inputs`` and ``outputs``, when given, are its signature (input names map to the program's
    arguments by position, in this order); else :meth:`load` reads them from the program.
    """

    inputs: Mapping[str, InputSpec] | None = None

    def __init__(self, name: str, path: Path, inputs: Mapping[str, InputSpec] | None = None,
                 outputs: Mapping[str, OutputSpec] | None = None) -> None:
        self.name = name
        self.path = path
        self.program: Any = None
        self.inputs = dict(inputs) if inputs is not None else None
        self.outputs = dict(outputs) if outputs is not None else None
        self.platform = "torch_export" if path.suffix == ".pt2" else "pytorch_libtorch"
        self._given = (inputs is not None, outputs is not None)
        #: The rows one call of the program takes (None: any).
        self._batch: BatchRange | None = None

    def load(self, device: torch.device) -> None:
        """Read the file onto ``device``, and the signature from its program unless given.

        Raises:
            ValueError: the file is not what its suffix says (a ``torch.save`` pickle, say) or
                torch cannot read it, or the given inputs are not as many as the program's
                arguments; the message names the model, the file and why in one line.
        """
        what = f"model '{self.name}': {self.path}"
        try:
            wrong = file_kind_refusal(self.path)
            if wrong:
                raise ValueError(f"{self.path} {wrong}")
            if self.path.suffix == ".pt2":
                exported = load_exported(self.path)
                signature = exported_signature(exported, self.batch_dimension)
                self.program = exported.module().to(device)
            else:
                self.program = torch.jit.load(str(self.path), map_location=device)
                self.program.eval()
                signature = script_signature(self.program)
        except ValueError as exc:  # the refusals above and load_exported's name the file
            raise ValueError(f"model '{self.name}': {exc}") from None
        except (RuntimeError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{what} cannot be loaded: {_reason(exc)}") from None
        self._take(signature, what)

    def _take(self, signature: ProgramSignature, what: str) -> None:
        """Keep the given signature, or take the program's."""
        given_inputs, given_outputs = self._given
        if given_inputs and self.inputs is not None and signature.arguments is not None:
            least, most = signature.arguments
            if not least <= len(self.inputs) <= most:
                takes = str(least) if least == most else f"{least} to {most}"
                raise ValueError(f"{what} declares {len(self.inputs)} input(s) "
                                 f"({', '.join(self.inputs)}); its program takes {takes}"
                                 + (f" ({', '.join(signature.inputs)})" if signature.inputs else ""))
        if not given_inputs:
            self.inputs = signature.inputs
            if signature.inputs is None:
                log.warning("model %s: no signature read from %s: %s; its inputs go to the "
                            "program in the order a request lists them, unchecked", self.name,
                            self.path, signature.why)
        if not given_outputs:
            self.outputs = signature.outputs
        self._batch = signature.batch
        # A TorchScript argument's shape is not known: a client has no row shape to check by.
        self.client_checks_inputs = not any(isinstance(s, AnyShape)
                                            for s in (self.inputs or {}).values())

    def forward(self, batch: Batch) -> Batch:
        args = ([batch[n] for n in self.inputs] if self.inputs is not None
                else list(batch.values()))
        rows = int(args[0].shape[0]) if args and len(args[0].shape) else 0
        if self._batch is None or not args or not self.batch_dimension or self._batch.fits(rows):
            return self._named(self.program(*args))
        parts: dict[str, list[Any]] = {}
        for start, stop in self._batch.pieces(rows):
            piece = [_padded(a[start:stop], self._batch.low) for a in args]
            for name, value in self._named(self.program(*piece)).items():
                parts.setdefault(name, []).append(value[:stop - start])
        return {name: torch.cat(values) for name, values in parts.items()}

    def _named(self, result: Any) -> Batch:
        """The program's result by output name (see the module)."""
        if isinstance(result, dict):
            return dict(result)
        several = isinstance(result, (tuple, list))
        results = list(result) if several else [result]
        names = list(self.outputs or ())
        if len(names) != len(results):
            names = [f"output_{i}" for i in range(len(results))] if several else ["output"]
        return dict(zip(names, results, strict=True))


def _padded(value: torch.Tensor, rows: int) -> torch.Tensor:
    """``value`` with zero rows added up to ``rows`` rows."""
    short = rows - int(value.shape[0])
    if short <= 0:
        return value
    return torch.cat([value, value.new_zeros((short, *value.shape[1:]))])


_RESAVE = ("save it with torch.jit.save(torch.jit.script(model), 'NAME.pt') or "
           "torch.export.save(torch.export.export(model, example_inputs), 'NAME.pt2')")
#: Python's pickle protocol 2+ opens with this byte: ``torch.save``'s legacy (non-zip) format.
_PICKLE_PROTO = 0x80


def file_kind_refusal(path: Path) -> str:
    """Why ``path`` is not the kind of file its suffix says ("" when it may be), read from the
    zip's table of contents alone — nothing in it is unpickled.

    ``torch.save`` writes a zip of ``data.pkl`` and tensors (a pickle of the module or state
    dict, which a worker never unpickles); TorchScript's ``torch.jit.save`` adds
    ``constants.pkl`` and ``code/``; ``torch.export.save`` writes ``archive_format``.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            first = f.read(1)
        if first and first[0] == _PICKLE_PROTO:
            return f"is a pickle (torch.save, legacy format); {_RESAVE}"
        return ""  # torch says what it is not
    leaves = {n.rsplit("/", 1)[-1] for n in names}
    torchscript = "constants.pkl" in leaves
    exported = "archive_format" in leaves
    if "data.pkl" in leaves and not torchscript and not exported:
        return f"is a pickle (torch.save), not a TorchScript or torch.export file; {_RESAVE}"
    if path.suffix == ".pt" and exported:
        return (f"is a torch.export program, which loads from a .pt2 file: rename it "
                f"{path.stem}.pt2")
    if path.suffix == ".pt2" and torchscript:
        return f"is a TorchScript program, which loads from a .pt file: rename it {path.stem}.pt"
    if path.suffix == ".pt2" and not exported:
        return "is not a torch.export archive (a zip without its archive_format entry)"
    return ""


def _reason(exc: BaseException) -> str:
    """Torch's reason in one line: its first, without the boilerplate torch adds to every
    archive error."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line.split(". This is an internal miniz error", 1)[0].rstrip(":")


#: Entries of an exported program's archive that ``torch.export.load`` unpickles as Python objects
#: (``torch/export/pt2_archive/_package.py``: custom and opaque object constants).
_PICKLED_OBJECTS = ("/data/constants/custom_obj_", "/data/constants/opaque_obj_")
#: Read by ``torch.load`` at each call: weights-only, whatever ``weights_only`` the caller passed.
_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_weights_only_lock = threading.Lock()


def load_exported(path: Path) -> Any:
    """``torch.export.load(path)`` with nothing unpickled but tensors.

    Raises:
        ValueError: The archive holds pickled Python objects, or a pickle the weights-only
            unpickler refuses; the message names the file and the rule.
    """
    rule = ("model files are never unpickled beyond tensors (torch's weights-only loader); "
            "export the program without Python object constants")
    with zipfile.ZipFile(path) as archive:
        pickled = [n for n in archive.namelist() if any(p in f"/{n}" for p in _PICKLED_OBJECTS)]
    if pickled:
        raise ValueError(f"model file {path}: holds pickled Python objects ({', '.join(pickled)}); "
                         f"{rule}")
    with _weights_only_lock:  # one load at a time sets and restores the variable
        before = os.environ.get(_WEIGHTS_ONLY)
        os.environ[_WEIGHTS_ONLY] = "1"
        try:
            return torch.export.load(str(path))
        except Exception as exc:  # the weights-only unpickler's refusal, named, not imported
            if type(exc).__name__ != "UnpicklingError":
                raise
            raise ValueError(f"model file {path}: holds a pickle that is not tensors; {rule}") from exc
        finally:
            if before is None:
                del os.environ[_WEIGHTS_ONLY]
            else:
                os.environ[_WEIGHTS_ONLY] = before
