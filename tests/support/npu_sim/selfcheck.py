"""What the simulated NPU does, printed as one JSON line (run with the simulation installed:
``python -m tests.support.npu_sim.selfcheck`` under :func:`~tests.support.npu_sim.hook.sim_env`)."""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from tests.support.npu_sim.runtime import SIM


def main() -> None:
    seen: dict[str, object] = {"accelerator": str(torch.accelerator.current_accelerator()),
                               "device_count": torch.accelerator.device_count()}
    torch.accelerator.set_device_index(1)
    other: list[int] = []

    def in_other_thread() -> None:
        other.append(torch.accelerator.current_device_index())

    t = threading.Thread(target=in_other_thread)
    t.start()
    t.join()
    seen["thread_devices"] = {"main": torch.accelerator.current_device_index(), "other": other[0]}
    x = torch.arange(12.0).reshape(3, 4)
    npu: Any = torch.npu  # type: ignore[attr-defined]
    stream = npu.Stream(torch.device("npu:1"))
    with stream:
        on_device = x.pin_memory().to("npu", non_blocking=True)
        back = (on_device * 2).to("cpu", non_blocking=True)
        event = npu.Event()
        event.record(stream)
        seen["before_wait"] = {"query": event.query(), "all_nan": bool(back.isnan().all())}
    event.synchronize()
    seen["after_wait"] = {"query": event.query(), "correct": bool(torch.equal(back, x * 2))}
    seen["physical"] = SIM.visible
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
