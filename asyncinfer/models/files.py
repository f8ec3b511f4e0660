"""Models loaded from files: TorchScript (``NAME.pt``) and ``torch.export`` programs (``NAME.pt2``).

Inputs are passed to the program positionally, in the order the request lists them; a single
tensor result is the output ``output``, a tuple or list gives ``output_0``, ``output_1``, …

Nothing in a model file is unpickled beyond tensors. TorchScript's own reader rebuilds only tensors
and TorchScript types (an archive naming any other Python global is refused by torch). An exported
program's archive is another matter: ``torch.export.load`` unpickles its pickled Python objects,
and retries a failed weights-only load of its example inputs with the full unpickler — a crafted
``.pt2`` would run code when the worker loads it. So an archive holding pickled objects is refused,
and the rest is loaded with every ``torch.load`` forced to torch's weights-only unpickler.
"""

from __future__ import annotations

import os
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch

from asyncinfer.models.base import Batch, Model

__all__ = ["FileModel", "FILE_SUFFIXES", "load_exported", "file_kind_refusal"]

FILE_SUFFIXES = (".pt", ".pt2")


class FileModel(Model):
    """A TorchScript or exported program read from ``path`` when the worker loads it."""

    inputs = None

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.program: Any = None

    def load(self, device: torch.device) -> None:
        """Read the file onto ``device``.

        Raises:
            ValueError: the file is not what its suffix says (a ``torch.save`` pickle, say) or
                torch cannot read it; the message names the model, the file and why in one line.
        """
        what = f"model '{self.name}': {self.path}"
        try:
            wrong = file_kind_refusal(self.path)
            if wrong:
                raise ValueError(f"{self.path} {wrong}")
            if self.path.suffix == ".pt2":
                self.program = load_exported(self.path).module().to(device)
            else:
                self.program = torch.jit.load(str(self.path), map_location=device)
                self.program.eval()
        except ValueError as exc:  # the refusals above and load_exported's name the file
            raise ValueError(f"model '{self.name}': {exc}") from None
        except (RuntimeError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{what} cannot be loaded: {_reason(exc)}") from None

    def forward(self, batch: Batch) -> Batch:
        result = self.program(*batch.values())
        if isinstance(result, (tuple, list)):
            return {f"output_{i}": r for i, r in enumerate(result)}
        if isinstance(result, dict):
            return dict(result)
        return {"output": result}


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
