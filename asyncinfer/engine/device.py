"""Device binding through the generic ``torch.accelerator`` API (one path for NPU, CUDA, CPU).

Visible-device variables are set before the first device call; the device is initialised only in
the worker process that owns it. CPU has no streams with events: there a result is complete when
the call returns.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceSpec", "parse_device", "bind_visible_device", "Device", "VISIBLE_DEVICE_VARS"]

#: The variable that limits which devices of a type a process sees.
VISIBLE_DEVICE_VARS = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}

_SPEC = re.compile(r"^(auto|cpu|[a-z][a-z0-9_]*)(?::(\d+))?$")


@dataclass(frozen=True)
class DeviceSpec:
    """A device name as users write it: ``cpu``, ``cuda:0``, ``npu:3``, or ``auto``."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def parse_device(spec: str) -> DeviceSpec:
    """Parse ``cpu``, ``auto``, ``cuda``, ``cuda:1``, ``npu:0``; ValueError otherwise."""
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"device {spec!r} must look like 'cpu', 'auto', 'cuda:0' or 'npu:0'")
    kind, index = m.group(1), m.group(2)
    if kind in ("cpu", "auto"):
        if index is not None:
            raise ValueError(f"device {spec!r}: '{kind}' takes no index")
        return DeviceSpec(kind)
    return DeviceSpec(kind, int(index) if index is not None else 0)


def bind_visible_device(spec: DeviceSpec,
                        environ: MutableMapping[str, str] | None = None) -> DeviceSpec:
    """Make only ``spec`` visible to this process and return its local name.

    Must run before the first device call. When the variable is already set (a container or a
    scheduler that gave this process some devices), a ``spec`` naming one of the IDs it lists
    (``ASCEND_RT_VISIBLE_DEVICES=4,5`` and ``npu:5``) narrows it to that one device, seen as
    index 0; any other ``spec`` is left alone, as an index among the devices already visible.
    """
    env = os.environ if environ is None else environ
    var = VISIBLE_DEVICE_VARS.get(spec.type)
    if var is None or spec.index is None:
        return spec
    given = env.get(var)
    if given and str(spec.index) not in [part.strip() for part in given.split(",")]:
        return spec
    env[var] = str(spec.index)
    return DeviceSpec(spec.type, 0)


class Device:
    """The one device a worker process owns: streams, events, copies.

    Args:
        spec: the local device (after :func:`bind_visible_device`), or ``auto``.
        label: the name reported in responses (the physical device, e.g. ``cuda:3``).
    """

    def __init__(self, spec: DeviceSpec, label: str | None = None) -> None:
        import torch

        if spec.type == "auto":
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            spec = DeviceSpec(acc.type, 0) if acc is not None else DeviceSpec("cpu")
        self.spec = spec
        self.label = label or str(spec)
        self.torch_device = torch.device(str(spec))
        self.is_accelerator = spec.type != "cpu"
        if self.is_accelerator:
            count = torch.accelerator.device_count()
            if spec.index is None or spec.index >= count:
                raise ValueError(f"device {self.label}: {count} {spec.type} device(s) visible")
        #: The backend's own stream and event classes where PyTorch's generic ones fall short
        #: (torch_npu), else ``torch.Stream`` / ``torch.Event``.
        self._stream_class, self._event_class = _stream_classes(torch, spec.type)

    def bind_thread(self) -> None:
        """Make this device current in the calling thread (current device is thread-local)."""
        if self.is_accelerator:
            import torch

            torch.accelerator.set_device_index(self.spec.index)

    def new_stream(self) -> Any:
        """A new stream on this device, or None on CPU."""
        if not self.is_accelerator:
            return None
        return self._stream_class(self.torch_device)

    @staticmethod
    def on_stream(stream: Any) -> AbstractContextManager[Any]:
        """Context that makes ``stream`` current (does nothing for None)."""
        return stream if stream is not None else nullcontext()

    def to_device(self, value: Any) -> Any:
        """Copy a host tensor to the device: pinned and non-blocking on accelerators."""
        import torch

        if not self.is_accelerator or not isinstance(value, torch.Tensor):
            return value
        return value.pin_memory().to(self.torch_device, non_blocking=True)

    def copy_into(self, dst: Any, value: Any) -> None:
        """Copy host tensor ``value`` into device tensor ``dst`` (of its shape): pinned and
        non-blocking on accelerators, on the current stream."""
        if self.is_accelerator:
            dst.copy_(value.pin_memory(), non_blocking=True)
        else:
            dst.copy_(value)

    def to_host(self, value: Any) -> Any:
        """Start the copy of a device tensor back to the host (complete after the stream's event)."""
        import torch

        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.to("cpu", non_blocking=True)
        return value

    def record_event(self, stream: Any) -> Any:
        """An event recorded on ``stream`` (None on CPU, where work is done when the call returns)."""
        if stream is None:
            return None
        if self._event_class is None:
            import torch

            event = torch.Event(self.torch_device, enable_timing=False)
        else:  # torch_npu's Event takes no device: it is recorded on its stream's
            event = self._event_class(enable_timing=False)
        event.record(stream)
        return event


def _stream_classes(torch: Any, kind: str) -> tuple[Any, Any]:
    """The stream class and event class (None: ``torch.Event``) for devices of type ``kind``.

    On ``npu`` they are ``torch.npu.Stream`` / ``torch.npu.Event``: torch_npu's device guard has
    no ``getNewStream`` (so ``torch.Stream("npu:0")`` is refused) and in some releases no
    ``synchronizeEvent`` (so ``torch.Event.synchronize()`` raises); its own classes subclass the
    generic ones and have both. CUDA and other backends use the generic classes.
    """
    module = getattr(torch, kind, None) if kind == "npu" else None
    stream_class = getattr(module, "Stream", None)
    event_class = getattr(module, "Event", None)
    if stream_class is None or event_class is None:
        return torch.Stream, None
    return stream_class, event_class
