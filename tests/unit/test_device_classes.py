"""Which stream and event classes a device uses: torch_npu's own on ``npu``, generic elsewhere."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncinfer.engine.device import Device, DeviceSpec, _stream_classes

pytestmark = pytest.mark.timeout(30)


class _NpuStream:
    def __init__(self, device: Any) -> None:
        self.device = device


class _NpuEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded_on: Any = None

    def record(self, stream: Any) -> None:
        self.recorded_on = stream


def _torch_with_npu() -> Any:
    return SimpleNamespace(Stream=torch.Stream, Event=torch.Event,
                           npu=SimpleNamespace(Stream=_NpuStream, Event=_NpuEvent),
                           cuda=SimpleNamespace(Stream=object, Event=object))


def test_npu_uses_torch_npus_own_stream_and_event() -> None:
    # torch_npu's guard refuses a generic torch.Stream on npu; torch.npu.Stream/Event work
    assert _stream_classes(_torch_with_npu(), "npu") == (_NpuStream, _NpuEvent)


@pytest.mark.parametrize("kind", ["cuda", "xpu", "cpu"])
def test_other_devices_keep_the_generic_classes(kind: str) -> None:
    assert _stream_classes(_torch_with_npu(), kind) == (torch.Stream, None)


def test_npu_without_its_own_classes_falls_back_to_the_generic_ones() -> None:
    fake = SimpleNamespace(Stream=torch.Stream, Event=torch.Event, npu=SimpleNamespace())
    assert _stream_classes(fake, "npu") == (torch.Stream, None)


def test_an_npu_event_is_made_without_a_device_and_recorded_on_the_stream() -> None:
    # Given: a device whose classes are torch_npu's (set as Device would on npu)
    device = Device(DeviceSpec("cpu"))
    device._stream_class, device._event_class = _NpuStream, _NpuEvent
    stream = _NpuStream(torch.device("cpu"))
    # When
    event = device.record_event(stream)
    # Then
    assert isinstance(event, _NpuEvent)
    assert event.recorded_on is stream and event.enable_timing is False


def test_cpu_device_makes_no_stream_and_no_event() -> None:
    device = Device(DeviceSpec("cpu"))
    assert device.new_stream() is None
    assert device.record_event(None) is None
