"""The simulated NPU's runtime: visible devices, the per-thread current device, streams, events,
the completion of queued work, and a log of what happened.

torch 2.13's Python PrivateUse1 backend gives a no-op device guard: ``set_device_index`` changes
nothing, every ``torch.Stream`` is stream 0, ``Event.synchronize`` is unsupported and there is no
pinned-memory allocator. So the simulation wraps the generic entry points a worker calls
(``torch.accelerator.set_device_index``, ``Tensor.pin_memory``) and provides ``torch.npu.Stream``
and ``torch.npu.Event`` as torch_npu does, classes that keep that state themselves, record each
call, and delegate to the real PrivateUse1 path where it works (stream and event objects on
``npu``). The generic ``torch.Stream`` and ``torch.Event`` behave on ``npu`` as torch_npu's device
guard makes them: no new generic stream, no ``Event.synchronize`` (see :class:`GenericStream`).

Asynchrony: a non-blocking copy to the host issued on a stream is queued on it (its destination
holds NaN until then); an event recorded on the stream takes the queued work, and the device thread
applies it ``NPU_SIM_DELAY_MS`` after the record. A reader that does not wait on the event reads
NaN.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SIM", "Simulator", "GenericStream", "SimStream", "SimEvent", "PHYSICAL_DEVICES"]

#: Devices the simulated host has (``npu:0``, ``npu:1``), before ``ASCEND_RT_VISIBLE_DEVICES``.
PHYSICAL_DEVICES = 2
VISIBLE_VAR = "ASCEND_RT_VISIBLE_DEVICES"

#: A copy the device does later: (destination host tensor, source values).
Write = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Completion:
    """Work an event covers, applied by the device thread at ``ready_at``."""

    ready_at: float
    writes: list[Write]
    done: threading.Event = field(default_factory=threading.Event)


class Simulator:
    """Process-wide state of the simulated NPUs."""

    def __init__(self) -> None:
        self.delay_s = float(os.environ.get("NPU_SIM_DELAY_MS", "20")) / 1000
        self._log_path = os.environ.get("NPU_SIM_LOG")
        self._log_lock = threading.Lock()
        self._local = threading.local()
        self._init_lock = threading.Lock()
        self.visible: list[int] | None = None  # physical IDs, fixed at the first device call
        self._stream_ids = itertools.count(1)
        self._pending: queue.Queue[_Completion] = queue.Queue()
        self._device_thread: threading.Thread | None = None

    # -- log ---------------------------------------------------------------------------------

    def record(self, what: str, **details: Any) -> None:
        """Append one JSON line to ``NPU_SIM_LOG`` (nothing when unset)."""
        if self._log_path is None:
            return
        entry = {"what": what, "thread": threading.current_thread().name,
                 "bound": self.bound_index(), **details}
        line = json.dumps(entry, default=str) + "\n"
        with self._log_lock, open(self._log_path, "a") as f:
            f.write(line)

    # -- devices -----------------------------------------------------------------------------

    def _visible_now(self) -> list[int]:
        value = os.environ.get(VISIBLE_VAR, "")
        if not value:
            return list(range(PHYSICAL_DEVICES))
        ids = [int(v) for v in value.split(",")]
        if ids != sorted(set(ids)) or not all(0 <= i < PHYSICAL_DEVICES for i in ids):
            raise RuntimeError(f"{VISIBLE_VAR}={value!r}: ascending IDs below {PHYSICAL_DEVICES}")
        return ids

    def device_count(self) -> int:
        """Visible devices (does not initialise, as on torch_npu)."""
        return len(self.visible if self.visible is not None else self._visible_now())

    def ensure_init(self, by: str) -> None:
        """The first device call fixes the visible devices, as CANN does at its init."""
        if self.visible is not None:
            return
        with self._init_lock:
            if self.visible is None:
                self.visible = self._visible_now()
                self.record("init", by=by, visible_var=os.environ.get(VISIBLE_VAR),
                            physical=self.visible)

    def physical(self, index: int) -> int:
        """The physical device behind local ``index``."""
        assert self.visible is not None
        if not 0 <= index < len(self.visible):
            raise RuntimeError(f"npu:{index}: {len(self.visible)} npu device(s) visible")
        return self.visible[index]

    def set_device(self, index: int) -> None:
        """Make local device ``index`` current in the calling thread."""
        self.ensure_init("set_device")
        self._local.index = index
        self.record("set_device", index=index, physical=self.physical(index))

    def bound_index(self) -> int | None:
        """The calling thread's device, or None when it never set one."""
        return getattr(self._local, "index", None)

    def current_index(self) -> int:
        index = self.bound_index()
        return 0 if index is None else index

    # -- streams and completion --------------------------------------------------------------

    def new_stream_id(self) -> int:
        return next(self._stream_ids)

    def current_stream(self) -> SimStream | None:
        stack = getattr(self._local, "streams", None)
        return stack[-1] if stack else None

    def push_stream(self, stream: SimStream) -> None:
        if not hasattr(self._local, "streams"):
            self._local.streams = []
        self._local.streams.append(stream)

    def pop_stream(self) -> None:
        self._local.streams.pop()

    # -- graph capture (tests/support/npu_sim/graphs.py) -------------------------------------

    def capturing(self) -> Any:
        """The graph capture under way in the calling thread, or None."""
        return getattr(self._local, "capture", None)

    def set_capture(self, capture: Any) -> None:
        self._local.capture = capture

    def refuse_in_capture(self, what: str) -> None:
        """Raise as the runtime does for a host synchronisation while a graph is captured."""
        if self.capturing() is not None:
            raise RuntimeError(f"simulated npu: {what} is not allowed while a graph is captured")

    def complete_later(self, writes: list[Write]) -> _Completion:
        """Queue ``writes``; the device thread applies them after the simulated delay."""
        self._start_device_thread()
        completion = _Completion(time.monotonic() + self.delay_s, writes)
        self._pending.put(completion)
        return completion

    def _start_device_thread(self) -> None:
        if self._device_thread is None:
            with self._init_lock:
                if self._device_thread is None:
                    self._device_thread = threading.Thread(target=self._device_loop,
                                                           name="npu-sim-device", daemon=True)
                    self._device_thread.start()

    def _device_loop(self) -> None:
        while True:  # in record order, each after its delay: the device's queue
            completion = self._pending.get()
            wait_s = completion.ready_at - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)  # the simulated kernel time
            try:
                with torch.inference_mode():  # destinations made in inference mode allow it
                    for dst, values in completion.writes:
                        dst.copy_(values)
            except Exception as exc:  # noqa: BLE001 - the device reports, the waiter goes on
                self.record("device_error", error=repr(exc))
            completion.done.set()


SIM = Simulator()


def _check_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("npu", SIM.current_index())
    if isinstance(device, int):
        return torch.device("npu", device)
    dev = torch.device(device)
    if dev.type != "npu":
        raise RuntimeError(f"simulated npu: device {dev} is not an npu")
    return dev if dev.index is not None else torch.device("npu", SIM.current_index())


class GenericStream(torch.Stream):
    """``torch.Stream`` as torch_npu leaves it: its device guard (NPUGuardImpl, read in its source)
    has no ``getNewStream``, so a generic stream on ``npu`` is refused with PyTorch's message."""

    def __new__(cls, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if device is not None and torch.device(device).type == "npu":
            raise RuntimeError("Backend doesn't support create a new Stream.")
        return super().__new__(cls, device, *args, **kwargs)


class SimStream(torch.Stream):
    """``torch.npu.Stream``: a stream with its own ID that knows the work queued on it."""

    sim_id: int
    sim_index: int
    writes: list[Write]
    completions: list[_Completion]

    def __new__(cls, device: torch.device | str | int | None = None, *, priority: int = 0,
                **kwargs: Any) -> SimStream:
        SIM.ensure_init("stream")
        dev = _check_device(device)
        self = super().__new__(cls, dev, priority=priority, **kwargs)
        self.sim_id = SIM.new_stream_id()
        self.sim_index = dev.index
        self.writes = []
        self.completions = []
        SIM.record("stream_new", stream=self.sim_id, index=dev.index,
                   physical=SIM.physical(dev.index))
        return self

    def __enter__(self) -> SimStream:
        SIM.push_stream(self)
        SIM.record("stream_enter", stream=self.sim_id)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        SIM.pop_stream()

    def take_work(self) -> _Completion:
        writes, self.writes = self.writes, []
        completion = SIM.complete_later(writes)
        self.completions.append(completion)
        return completion

    def synchronize(self) -> None:
        SIM.refuse_in_capture("Stream.synchronize")
        SIM.record("stream_sync", stream=self.sim_id)
        self.take_work().done.wait()

    def query(self) -> bool:
        return not self.writes and all(c.done.is_set() for c in self.completions)

    def record_event(self, event: Any = None) -> SimEvent:
        event = event or SimEvent()
        event.record(self)
        return event


class SimEvent(torch.Event):
    """``torch.npu.Event``: it completes when the device thread has done the work queued before it.

    The generic ``torch.Event`` is left as the Python backend has it: its ``synchronize`` raises
    "Backend doesn't support synchronizing events", as on torch_npu releases whose NPUGuardImpl
    lacks ``synchronizeEvent``."""

    sim_index: int
    completion: _Completion | None
    stream_id: int | None

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False) -> SimEvent:
        # torch_npu's Event takes no device: it is recorded on its stream's device
        SIM.ensure_init("event")
        dev = _check_device(None)
        self = super().__new__(cls, dev, enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)
        self.sim_index = dev.index
        self.completion = None
        self.stream_id = None
        return self

    def record(self, stream: Any = None) -> None:
        stream = stream if stream is not None else SIM.current_stream()
        if not isinstance(stream, SimStream):
            raise RuntimeError("simulated npu: event recorded on a stream it does not know")
        self.stream_id = stream.sim_id
        self.completion = stream.take_work()
        SIM.record("event_record", stream=stream.sim_id, writes=len(self.completion.writes))
        super().record(stream)

    def query(self) -> bool:
        SIM.record("event_query", stream=self.stream_id)
        return self.completion is None or self.completion.done.is_set()

    def synchronize(self) -> None:
        SIM.refuse_in_capture("Event.synchronize")
        SIM.record("event_sync", stream=self.stream_id)
        if self.completion is not None:
            self.completion.done.wait()  # blocks without the GIL, like aclrtSynchronizeEvent

    def wait(self, stream: Any = None) -> None:
        SIM.record("event_wait", stream=self.stream_id)
        if self.completion is not None:
            self.completion.done.wait()


def set_device_index(device: torch.device | str | int | None, /) -> None:
    """``torch.accelerator.set_device_index`` on the simulated NPU (thread-local, as on CANN)."""
    SIM.set_device(_check_device(device).index or 0)


def current_device_index() -> int:
    return SIM.current_index()


def synchronize(device: Any = None) -> None:
    """Wait for every queued completion."""
    SIM.refuse_in_capture("synchronize")
    SIM.record("device_sync")
    done = SIM.complete_later([])
    done.done.wait()
