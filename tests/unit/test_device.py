"""Device names, visible-device binding and the CPU device (this machine has no accelerator)."""

from __future__ import annotations

import pytest
import torch

from asyncinfer.engine.device import (
    VISIBLE_DEVICE_VARS,
    Device,
    DeviceSpec,
    bind_visible_device,
    parse_device,
)

pytestmark = pytest.mark.timeout(30)

needs_cpu_only = pytest.mark.skipif(torch.accelerator.is_available(),
                                    reason="checks the behaviour of a machine without an accelerator")


@pytest.mark.parametrize(("text", "expected"), [
    ("cpu", DeviceSpec("cpu")),
    ("CPU", DeviceSpec("cpu")),
    ("auto", DeviceSpec("auto")),
    (" auto ", DeviceSpec("auto")),
    ("cuda", DeviceSpec("cuda", 0)),
    ("cuda:1", DeviceSpec("cuda", 1)),
    ("npu:3", DeviceSpec("npu", 3)),
    ("npu", DeviceSpec("npu", 0)),
])
def test_parse_device(text: str, expected: DeviceSpec) -> None:
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["", "cuda:", "cuda:-1", "cuda:1:2", ":0", "0", "cuda 0", "cpu:0", "auto:1"])
def test_parse_device_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ValueError, match="device") as info:
        parse_device(text)
    assert repr(text) in str(info.value)


def test_device_spec_str() -> None:
    assert str(DeviceSpec("cpu")) == "cpu"
    assert str(DeviceSpec("npu", 3)) == "npu:3"
    assert str(parse_device("cuda")) == "cuda:0"


@pytest.mark.parametrize(("spec", "var"), [("cuda:1", "CUDA_VISIBLE_DEVICES"),
                                            ("npu:3", "ASCEND_RT_VISIBLE_DEVICES")])
def test_bind_visible_device_sets_the_variable(spec: str, var: str) -> None:
    # Given: an environment without the visible-device variable
    env: dict[str, str] = {"OTHER": "x"}
    # When
    local = bind_visible_device(parse_device(spec), env)
    # Then: only the requested device is visible, and it is index 0 locally
    assert env[var] == spec.split(":")[1]
    assert local == DeviceSpec(spec.split(":")[0], 0)
    assert env["OTHER"] == "x" and len(env) == 2
    assert VISIBLE_DEVICE_VARS[local.type] == var


def test_bind_visible_device_leaves_a_set_variable_alone() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    local = bind_visible_device(DeviceSpec("cuda", 1), env)
    assert env == {"CUDA_VISIBLE_DEVICES": "5"}
    assert local == DeviceSpec("cuda", 1)


def test_bind_visible_device_narrows_a_set_variable_to_a_device_it_lists() -> None:
    # a scheduler gave this process physical devices 4 and 5; the worker asked for npu:5
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4, 5"}
    assert bind_visible_device(DeviceSpec("npu", 5), env) == DeviceSpec("npu", 0)
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "5"}
    # an index it does not list is one among the visible devices, left as given
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    assert bind_visible_device(DeviceSpec("npu", 1), env) == DeviceSpec("npu", 1)
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}


def test_bind_visible_device_treats_an_empty_variable_as_unset() -> None:
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert bind_visible_device(DeviceSpec("cuda", 2), env) == DeviceSpec("cuda", 0)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}


@pytest.mark.parametrize("spec", ["cpu", "auto"])
def test_bind_visible_device_does_nothing_for_cpu_and_auto(spec: str) -> None:
    env: dict[str, str] = {}
    assert bind_visible_device(parse_device(spec), env) == parse_device(spec)
    assert env == {}


def test_cpu_device() -> None:
    device = Device(DeviceSpec("cpu"))
    assert device.is_accelerator is False
    assert device.torch_device == torch.device("cpu")
    assert device.label == "cpu"
    stream = device.new_stream()
    assert stream is None
    assert device.record_event(stream) is None
    x = torch.arange(6.0).reshape(2, 3)
    assert device.to_device(x) is x
    assert device.to_host(x) is x
    with device.on_stream(stream):
        pass
    device.bind_thread()  # a no-op on CPU
    assert Device(DeviceSpec("cpu"), label="host-7").label == "host-7"


@needs_cpu_only
def test_auto_resolves_to_cpu_here() -> None:
    device = Device(parse_device("auto"))
    assert device.spec == DeviceSpec("cpu")
    assert device.label == "cpu"
    assert device.is_accelerator is False
    assert device.new_stream() is None


@needs_cpu_only
def test_cuda_device_without_cuda_names_the_device() -> None:
    with pytest.raises(ValueError) as info:
        Device(parse_device("cuda:0"))
    assert "cuda:0" in str(info.value)
    assert "0 cuda device(s) visible" in str(info.value)


@needs_cpu_only
def test_missing_device_error_names_the_label() -> None:
    with pytest.raises(ValueError, match="cuda:3"):
        Device(DeviceSpec("cuda", 0), label="cuda:3")
