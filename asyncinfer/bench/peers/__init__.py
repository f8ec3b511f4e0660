"""Triton (through PyTriton) and Ray Serve, measured beside asyncinfer on the same model.

The peers pin their own dependencies, so they live in a venv of their own (``make peers`` makes
``.venv-peers``). The bench, in the project's venv, starts a peer's server and its load generator
from that venv with the project on ``PYTHONPATH``: both build the model and the requests from the
bench's own workloads, so every system serves the same model with the same max batch and delay.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PEERS", "PEERS_VENV_ENV", "peers_python", "project_root", "missing_message"]

#: The peer systems ``asyncinfer bench --systems`` knows.
PEERS = ("triton", "ray")
#: Names another venv for the peers (default: ``.venv-peers`` in the project root).
PEERS_VENV_ENV = "ASYNCINFER_PEERS_VENV"


def project_root() -> Path:
    """The folder that holds the ``asyncinfer`` package (what the peers' ``PYTHONPATH`` names)."""
    return Path(__file__).resolve().parents[3]


def peers_python() -> Path | None:
    """The peers venv's interpreter, or None when that venv is not there."""
    venv = Path(os.environ.get(PEERS_VENV_ENV) or project_root() / ".venv-peers")
    python = venv / "bin" / "python"
    return python if python.exists() else None


def missing_message(system: str) -> str:
    """The one line the bench prints when ``system`` cannot run here."""
    return (f"bench: skipping {system}: the peers venv (.venv-peers) is not there; "
            f"`make peers` installs Triton (PyTriton) and Ray Serve into it")
