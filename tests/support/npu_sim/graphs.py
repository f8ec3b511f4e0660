"""Graphs on the simulated NPU: ``torch.npu.NPUGraph``, ``torch.npu.graph`` and
``torch.npu.graph_pool_handle`` as torch_npu has them (torch_npu/npu/graphs.py), recorded in the log.

A capture records every op launched on device tensors by the capturing thread (tensors.py) as a
step: the op, the device tensors it read and the ones it returned. A replay runs the steps again on
those same tensors, writing each result into the tensor the step returned at capture: the graph
reads its inputs and writes its outputs at fixed addresses, so what was not copied into the
captured inputs is not seen, and a replay overwrites the outputs of the last. As on the device, a
capture does not compute: when it ends, the tensors made during it hold NaN until a replay. A copy
between host and device or a host synchronisation during a capture raises, as the runtime does.

Logged: ``graph_capture`` (the graph, its steps, its pool, and the tensors it reads that it did
not make: inputs and weights, by storage and shape), ``graph_capture_failed`` (a capture that
raised) and ``graph_replay`` (the graph, the stream);
``graph_replay_overlap`` when two threads replay one graph at once (they would share its buffers).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tests.support.npu_sim import runtime
from tests.support.npu_sim.runtime import SIM
from tests.support.npu_sim.tensors import host_of, rerun, storage_of

__all__ = ["SimGraph", "graph", "graph_pool_handle"]

_ids = itertools.count(1)


def graph_pool_handle() -> tuple[int, int]:
    """A new memory pool's token (the simulation keeps no pools: only the token is logged)."""
    return (next(_ids), 0)


@dataclass
class _Step:
    op: Any
    args: Any
    kwargs: dict[str, Any]
    out: Any


@dataclass
class _Capture:
    """A capture under way in one thread."""

    steps: list[_Step] = field(default_factory=list)
    #: storage → shape of the device tensors read that the capture did not make
    reads: dict[int, list[int]] = field(default_factory=dict)
    made: set[int] = field(default_factory=set)
    #: What non-view steps returned that the capture made: NaN when it ends.
    fresh: list[torch.Tensor] = field(default_factory=list)

    def step(self, op: Any, args: Any, kwargs: dict[str, Any], out: Any, view: bool) -> None:
        for x in pytree.tree_leaves((args, kwargs)):
            if _on_npu(x) and (where := storage_of(x)) not in self.made:
                self.reads.setdefault(where, list(x.shape))
        for x in pytree.tree_leaves(out):
            if _on_npu(x) and (where := storage_of(x)) not in self.reads:
                self.made.add(where)
                if not view:
                    self.fresh.append(x)
        self.steps.append(_Step(op, args, kwargs, out))

    def leave_unrun(self) -> None:
        """What a capture leaves in the tensors it made: nothing computed yet."""
        for x in self.fresh:
            if x.is_floating_point():
                host_of(x).fill_(float("nan"))


def _on_npu(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "npu"


class SimGraph:
    """``torch.npu.NPUGraph``."""

    def __init__(self) -> None:
        self.sim_id = next(_ids)
        self._steps: list[_Step] | None = None
        self._pool: tuple[int, int] | None = None
        self._replaying = threading.Lock()

    def capture_begin(self, pool: tuple[int, int] | None = None,
                      capture_error_mode: str = "global") -> None:
        if SIM.capturing() is not None:
            raise RuntimeError("simulated npu: a capture is already under way in this thread")
        self._pool = pool if pool is not None else (self.sim_id, 0)
        SIM.set_capture(_Capture())

    def capture_end(self) -> None:
        capture = SIM.capturing()
        if capture is None:
            raise RuntimeError("simulated npu: capture_end without capture_begin")
        SIM.set_capture(None)
        capture.leave_unrun()
        self._steps = capture.steps
        stream = SIM.current_stream()
        SIM.record("graph_capture", graph=self.sim_id, steps=len(capture.steps),
                   pool=list(self._pool or ()), stream=stream.sim_id if stream else None,
                   reads=[{"storage": k, "shape": v} for k, v in capture.reads.items()])

    def abandon(self, error: BaseException) -> None:
        """End a capture that raised: the runtime invalidates it; nothing can be replayed."""
        SIM.set_capture(None)
        SIM.record("graph_capture_failed", graph=self.sim_id, error=repr(error))

    def replay(self) -> None:
        if self._steps is None:
            raise RuntimeError("simulated npu: replay of a graph that was never captured")
        SIM.refuse_in_capture("a replay")
        if SIM.bound_index() is None:
            SIM.record("unbound_launch", op="graph_replay")
        stream = SIM.current_stream()
        SIM.record("graph_replay", graph=self.sim_id, stream=stream.sim_id if stream else None)
        if not self._replaying.acquire(blocking=False):
            SIM.record("graph_replay_overlap", graph=self.sim_id)
            self._replaying.acquire()
        try:
            with torch.inference_mode():
                for step in self._steps:
                    rerun(step.op, step.args, step.kwargs, step.out)
        finally:
            self._replaying.release()

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("simulated npu: pool() of a graph that was never captured")
        return self._pool

    def reset(self) -> None:
        self._steps = None


class graph:  # noqa: N801 - torch_npu's name
    """``torch.npu.graph``: capture on ``stream`` (default: one side stream for all captures)."""

    default_capture_stream: runtime.SimStream | None = None

    def __init__(self, npu_graph: SimGraph, pool: tuple[int, int] | None = None,
                 stream: runtime.SimStream | None = None, auto_dispatch_capture: bool = False,
                 capture_error_mode: str = "global") -> None:
        if graph.default_capture_stream is None:
            graph.default_capture_stream = runtime.SimStream()
        self.stream = stream if stream is not None else graph.default_capture_stream
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        runtime.synchronize()  # as torch_npu's does before a capture
        self.stream.__enter__()
        self.npu_graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            if error is None:
                self.npu_graph.capture_end()
            else:
                self.npu_graph.abandon(error)
        finally:
            self.stream.__exit__(kind, error, traceback)
