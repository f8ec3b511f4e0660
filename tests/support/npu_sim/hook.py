"""How a test starts a process on the simulated NPU: a ``sitecustomize`` that installs it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["sim_env", "read_log"]

_SITECUSTOMIZE = "from tests.support.npu_sim import install\n\ninstall()\n"


def sim_env(folder: Path, root: Path, delay_ms: float = 20.0) -> dict[str, str]:
    """Environment entries for a subprocess (working in ``root``) that runs on the simulated NPU,
    logging to ``folder/npu_sim.jsonl``; the simulation is installed before anything else runs."""
    site = folder / "npu_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(root)]),
            "NPU_SIM_LOG": str(folder / "npu_sim.jsonl"), "NPU_SIM_DELAY_MS": str(delay_ms)}


def read_log(folder: Path) -> list[dict[str, object]]:
    """What the simulation recorded in the process started with :func:`sim_env`."""
    import json

    path = folder / "npu_sim.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
