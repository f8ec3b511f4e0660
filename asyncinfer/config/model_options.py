"""Per-model batching and instance options: model defaults, overridden by configuration.

``ASYNCINFER_MODEL_OPTIONS`` is a JSON object of model name → options, e.g.
``{"minilm": {"max_batch_size": 64, "max_delay_ms": 5, "preferred_batch_sizes": [16, 32],
"instances": 2}}``; the key ``"*"`` applies to every model. The knobs are Triton's:
``max_batch_size``, ``max_delay_ms`` (its ``max_queue_delay``), ``preferred_batch_sizes`` and
``instances`` (its ``instance_group.count``), ``max_queue_size`` (its queue policy's bound,
checked when a client submits); ``pipelined`` runs preprocess, device and postprocess
of successive batches in parallel (False: one after another in one thread).
``warmup`` (default true) runs a batch of each size before the worker serves (Triton's
``model_warmup``); ``compile`` ``"torchscript"`` traces the forward at load (engine/compile.py).
``graph_batch_sizes`` (vLLM's ``cudagraph_capture_sizes``; default none) captures one CUDA or NPU
graph of the forward per size at load and runs each batch padded to the nearest size
(engine/graphs.py).
``response_cache`` (Triton's; default false) answers a repeated request (the same model, inputs
and parameters, to the bit) from Redis without running it: for deterministic models only. Entries
live ``response_cache_ttl_s`` and a model keeps at most ``response_cache_max_entries``
(broker/response_cache.py). Clients read the option too: set it where both see it.
``dead_letter`` keeps each request of the model that fails for good in
``asyncinfer:dead:<model>``
(at most ``dead_letter_max_entries``, the list expiring ``dead_letter_ttl_s`` after the last one).
``stream_max_parts`` (a decoupled model's; default 10000): the entries a request's stream holds at
most (wire/stream.py); past it the oldest are trimmed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from asyncinfer.config.priority_policy import LevelPolicy, parse_priority_policy, policy_for

__all__ = ["ModelOptions", "parse_model_options", "COMPILE_MODES"]

#: What the ``compile`` option takes ("": eager).
COMPILE_MODES = ("", "torchscript")
#: ``max_cost_ratio`` by default on a CPU and on an accelerator (ModelOptions.cost_ratio).
CPU_COST_RATIO, ACCELERATOR_COST_RATIO = 1.25, 2.0


@dataclass(frozen=True)
class ModelOptions:
    """How one model is batched and run."""

    max_batch_size: int = 32
    max_delay_ms: float = 2.0
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: int = 1
    pipelined: bool = True
    #: Requests waiting in ``infer.<model>`` at most (Triton's ``max_queue_size``): a client's
    #: ``submit`` waits up to its ``timeout_s`` for room, then raises QueueFull. 0: no bound.
    max_queue_size: int = 0
    #: Keep requests that failed for good in ``asyncinfer:dead:<model>`` (see dead_letters.py).
    dead_letter: bool = False
    #: The newest this many are kept; older ones are trimmed away.
    dead_letter_max_entries: int = 10000
    #: The list expires this long after its newest entry (7 days); 0: never.
    dead_letter_ttl_s: float = 7 * 24 * 3600.0
    #: Run one batch of each size before serving (Triton's ``model_warmup``; engine/warmup.py).
    warmup: bool = True
    #: Compile the forward at load: "" (eager) or "torchscript" (traced, frozen, checked against
    #: eager; engine/compile.py). A model that cannot runs eager, and the worker says so.
    compile: str = ""
    #: Fill each batch with the rows nearest in cost to its oldest, when the model says what a row
    #: costs (``Model.row_cost``: MiniLM, its length), instead of in arrival order (a batch runs
    #: padded to its longest row). False: arrival order.
    group_by_cost: bool = True
    #: ...a batch then takes only rows within this ratio of each other's cost (>= 1): a much
    #: shorter row would run at the long one's cost. None: by the device (:meth:`cost_ratio`).
    max_cost_ratio: float | None = None
    #: Capture one CUDA / NPU graph of the forward per batch size at load (vLLM's
    #: ``cudagraph_capture_sizes``); a batch replays the smallest size that holds its rows,
    #: padded, and a larger batch runs eager (engine/graphs.py). Empty: eager only; ignored on CPU.
    graph_batch_sizes: tuple[int, ...] = ()
    #: Answer a repeated request from Redis (Triton's ``response_cache``; broker/response_cache.py):
    #: only for a deterministic model. Read by the client at submit and by the worker.
    response_cache: bool = False
    #: How long a cached answer lives (seconds, > 0).
    response_cache_ttl_s: float = 600.0
    #: The most cached answers the model keeps; the oldest go first.
    response_cache_max_entries: int = 10000
    #: A batch is formed from the best Celery priority level waiting first (0 on Redis); a
    #: request passed over by this many batches (of requests that came after it) counts as the
    #: best level: the bound on how long a low level waits in the worker behind a stream of
    #: higher ones (engine/batcher.py).
    max_priority_passes: int = 8
    #: Per-level queue policy (Triton's ``priority_queue_policy``; config/priority_policy.py):
    #: level (kombu's priority step 0, 3, 6, 9) → ``max_queue_size``, ``default_timeout_s``.
    #: Read by the client at submit. Empty: none.
    priority_queue_policy: tuple[tuple[int, LevelPolicy], ...] = ()
    #: A decoupled model's requests: the entries (parts, ``start`` and ``final`` markers) each
    #: one's stream holds at most; past it the oldest are trimmed (wire/stream.py).
    stream_max_parts: int = 10000

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if not (isinstance(self.max_delay_ms, (int, float)) and math.isfinite(self.max_delay_ms)
                and self.max_delay_ms >= 0):
            raise ValueError(f"max_delay_ms must be a finite number >= 0, got {self.max_delay_ms!r}")
        if not isinstance(self.max_queue_size, int) or self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be an integer >= 0, got {self.max_queue_size!r}")
        ratio = self.max_cost_ratio
        if ratio is not None and not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                and math.isfinite(ratio) and ratio >= 1):
            raise ValueError(f"max_cost_ratio must be a finite number >= 1, got {ratio!r}")
        for flag in ("dead_letter", "warmup", "pipelined", "group_by_cost", "response_cache"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        max_entries, ttl_s = self.dead_letter_max_entries, self.dead_letter_ttl_s
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"dead_letter_max_entries must be an integer >= 1, got {max_entries!r}")
        if not (isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool)
                and math.isfinite(ttl_s) and ttl_s >= 0):
            raise ValueError(f"dead_letter_ttl_s must be a finite number >= 0, got {ttl_s!r}")
        object.__setattr__(self, "priority_queue_policy",
                           parse_priority_policy(self.priority_queue_policy))
        max_parts = self.stream_max_parts
        if not isinstance(max_parts, int) or isinstance(max_parts, bool) or max_parts < 1:
            raise ValueError(f"stream_max_parts must be an integer >= 1, got {max_parts!r}")
        passes = self.max_priority_passes
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"max_priority_passes must be an integer >= 1, got {passes!r}")
        cache_ttl_s, cache_entries = self.response_cache_ttl_s, self.response_cache_max_entries
        if not (isinstance(cache_ttl_s, (int, float)) and not isinstance(cache_ttl_s, bool)
                and math.isfinite(cache_ttl_s) and cache_ttl_s > 0):
            raise ValueError(f"response_cache_ttl_s must be a finite number > 0, got {cache_ttl_s!r}")
        if (not isinstance(cache_entries, int) or isinstance(cache_entries, bool)
                or cache_entries < 1):
            raise ValueError(f"response_cache_max_entries must be an integer >= 1, "
                             f"got {cache_entries!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {list(COMPILE_MODES)}, got {self.compile!r}")
        if not isinstance(self.instances, int) or self.instances < 1:
            raise ValueError(f"instances must be an integer >= 1, got {self.instances!r}")
        for name in ("preferred_batch_sizes", "graph_batch_sizes"):
            sizes = getattr(self, name)
            if isinstance(sizes, list):
                sizes = tuple(sizes)
                object.__setattr__(self, name, sizes)  # a list from a caller: the tuple it means
            if not isinstance(sizes, tuple) or not all(
                    isinstance(size, int) and not isinstance(size, bool)
                    and 1 <= size <= self.max_batch_size for size in sizes):
                raise ValueError(f"{name} must be integers in 1..max_batch_size "
                                 f"({self.max_batch_size}), got {_listed(sizes)!r}")

    def cost_ratio(self, accelerator: bool) -> float:
        """The ``max_cost_ratio`` a batch keeps to on a device: the option, or by default 1.25 on
        a CPU (its time follows the padded tokens, and a batch past a few rows gains little) and
        2 on an accelerator (a batch's time hardly moves with its rows or their padding until the
        device is full, so fuller batches beat tighter ones)."""
        if self.max_cost_ratio is not None:
            return float(self.max_cost_ratio)
        return ACCELERATOR_COST_RATIO if accelerator else CPU_COST_RATIO

    def level_policy(self, priority: int) -> LevelPolicy:
        """The queue policy of the level a request of ``priority`` (0-9) goes to."""
        return policy_for(self.priority_queue_policy, priority)

    def merged(self, overrides: dict[str, Any]) -> ModelOptions:
        """These options with ``overrides`` applied (unknown keys raise ValueError)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown model option(s) {sorted(unknown)}; known: {sorted(known)}")
        values = dict(overrides)
        for name in ("preferred_batch_sizes", "graph_batch_sizes"):
            if name in values:
                values[name] = _sorted_sizes(values[name])
        return dataclasses.replace(self, **values)


def _sorted_sizes(sizes: Any) -> Any:
    """Sizes from configuration, sorted, without repeats; what cannot be sorted is left as it is
    for the checks to name."""
    if not isinstance(sizes, (list, tuple)):
        return sizes
    try:
        return tuple(sorted(set(sizes)))
    except TypeError:  # not numbers
        return sizes


def _listed(sizes: Any) -> Any:
    return list(sizes) if isinstance(sizes, tuple) else sizes


def parse_model_options(text: str) -> dict[str, dict[str, Any]]:
    """Parse ``ASYNCINFER_MODEL_OPTIONS``: a JSON object of model name → option overrides."""
    if not text.strip():
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"ASYNCINFER_MODEL_OPTIONS is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ValueError("ASYNCINFER_MODEL_OPTIONS must be a JSON object of model name → {option: value}")
    return doc
