"""A simulated Ascend NPU for tests: PyTorch's PrivateUse1 backend renamed ``npu`` (the seam
torch_npu uses), two devices, tensors whose ops run on CPU, streams and events that record what
happened and complete after a delay.

Test-only; the package never imports it. A worker subprocess loads it through
:func:`tests.support.npu_sim.hook.sim_env` (a ``sitecustomize`` on its ``PYTHONPATH``) before
anything else runs, and ``import torch_npu`` finds it. :func:`install` is the whole setup;
importing this package does not touch torch.
"""

from __future__ import annotations

import sys
import types

__all__ = ["install"]

_installed: list[bool] = []


def install() -> None:
    """Register the simulated ``npu`` backend in this process (once)."""
    if _installed:
        return
    import torch
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from tests.support.npu_sim import runtime, tensors
    from tests.support.npu_sim.module import NpuModule

    module = NpuModule()
    _setup_privateuseone_for_python_backend("npu", backend_module=module)
    tensors.register_kernels()
    acc = torch.accelerator
    for name in ("set_device_index", "set_device_idx"):
        setattr(acc, name, runtime.set_device_index)
    for name in ("current_device_index", "current_device_idx"):
        setattr(acc, name, runtime.current_device_index)
    acc.synchronize = runtime.synchronize
    torch.Stream = runtime.GenericStream  # type: ignore[misc, assignment]
    torch.Tensor.pin_memory = tensors.pin_memory  # type: ignore[method-assign, assignment]
    torch.Tensor.is_pinned = tensors.is_pinned  # type: ignore[method-assign, assignment]
    # What ``import torch_npu`` finds: the simulation stands in for the real package.
    stand_in = types.ModuleType("torch_npu", "The simulated NPU (tests/support/npu_sim).")
    stand_in.npu = module  # type: ignore[attr-defined]
    stand_in.__version__ = "0+npu-sim"  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = stand_in
    _installed.append(True)
