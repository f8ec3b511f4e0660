"""``torch.npu`` of the simulation: the device module PyTorch calls for PrivateUse1."""

from __future__ import annotations

from typing import Any

from tests.support.npu_sim import graphs, runtime
from tests.support.npu_sim.runtime import SIM

__all__ = ["NpuModule"]


class NpuModule:
    """The calls torch_npu's ``torch.npu`` answers that PyTorch and the worker use."""

    Stream = runtime.SimStream
    Event = runtime.SimEvent
    NPUGraph = graphs.SimGraph
    graph = graphs.graph
    graph_pool_handle = staticmethod(graphs.graph_pool_handle)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return SIM.visible is not None

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return SIM.device_count()

    @staticmethod
    def set_device(device: Any) -> None:
        runtime.set_device_index(device)

    @staticmethod
    def current_device() -> int:
        return SIM.current_index()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        runtime.synchronize(device)

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return SIM.current_stream()
