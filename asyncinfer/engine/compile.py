"""The ``compile`` model option: the forward compiled at load, checked against eager, or eager.

``compile: "torchscript"`` asks the model to trace its forward (``torch.jit.trace``, then
``torch.jit.freeze``): the graph runs without the GIL between operators, so serving threads no
longer stall the model's Python (MiniLM on 2 CPU cores: +7 % sentences/s served, the same share of
its own in-process limit; bench/results/HISTORY.md, "What moved minilm from 0.49 to 0.64–0.69 of its
limit"). A model says whether it can with
:meth:`Model.compile`, which checks the traced forward against eager on batches of its own before
it is used; when it cannot, or the check fails, the model runs eager and the worker logs why.
``torch.compile`` (inductor) did not help MiniLM on CPU (337 against 338 rows/s after a 30 s
compile), so it is not offered yet.
"""

from __future__ import annotations

import logging
import time

import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Model

__all__ = ["compile_model"]

log = logging.getLogger(__name__)


def compile_model(model: Model, device: torch.device, options: ModelOptions) -> bool:
    """Compile ``model``'s forward as ``options.compile`` asks; True when it now runs compiled."""
    mode = options.compile
    if not mode:
        return False
    began = time.perf_counter()
    try:
        done = model.compile(mode, device)
    except Exception as exc:  # noqa: BLE001 - a model may raise anything; eager still serves
        log.warning("model %s: compile=%s raised %s: %s; running eager", model.name, mode,
                    type(exc).__name__, exc)
        return False
    if done:
        log.info("model %s: forward compiled (%s) in %.1f s", model.name, mode,
                 time.perf_counter() - began)
    else:
        log.warning("model %s does not support compile=%s; running eager", model.name, mode)
    return done
