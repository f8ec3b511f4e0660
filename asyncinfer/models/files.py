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

__all__ = ["FileModel", "FILE_SUFFIXES", "load_exported"]

FILE_SUFFIXES = (".pt", ".pt2")


class FileModel(Model):
    """A TorchScript or exported program read from ``path`` when the worker loads it."""

    inputs = None

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.program: Any = None

    def load(self, device: torch.device) -> None:
        if self.path.suffix == ".pt2":
            self.program = load_exported(self.path).module().to(device)
        else:
            self.program = torch.jit.load(str(self.path), map_location=device)
            self.program.eval()

    def forward(self, batch: Batch) -> Batch:
        result = self.program(*batch.values())
        if isinstance(result, (tuple, list)):
            return {f"output_{i}": r for i, r in enumerate(result)}
        if isinstance(result, dict):
            return dict(result)
        return {"output": result}


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
