"""How a test starts a process on the simulated NPU: a ``sitecustomize`` that installs it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["sim_env", "read_log", "sim_worker"]

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


@contextlib.contextmanager
def sim_worker(redis_url: str, folder: Path, device: str, models: str, hostname: str,
               model_options: str, **env: str) -> Iterator[tuple[Any, Any]]:
    """A worker on the simulated NPU ``device`` (logging in ``folder``) serving ``models`` with
    ``model_options``, and a client of it; both stopped on exit (the worker by its PID)."""
    from asyncinfer.client import Client
    from tests.support.processes import ROOT, start_worker

    proc = start_worker(redis_url, folder / "worker.log", "--device", device, "--models", models,
                        "--hostname", hostname, ASYNCINFER_MODEL_OPTIONS=model_options,
                        **sim_env(folder, ROOT), **env)
    client = Client(broker_url=redis_url)
    try:
        yield client, proc
    finally:
        client.close()
        proc.stop()
