"""A model's v2 metadata and the part of Triton's ModelConfig the gateway answers, from its
catalogue entry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncinfer.catalogue import CatalogueEntry
from asyncinfer.wire.payloads import DATATYPES

__all__ = ["SERVER_NAME", "model_metadata", "model_config", "is_decoupled"]

#: The gateway's name (ServerMetadata's) and the backend its model configs name.
SERVER_NAME = "asyncinfer"


def model_metadata(model: str, entry: CatalogueEntry) -> dict[str, Any]:
    """The v2 model metadata (``name``, ``versions``, ``platform``, ``inputs``, ``outputs``)."""
    meta = entry.metadata
    return {"name": model, "versions": entry.versions,
            "platform": str(meta.get("platform", "pytorch")),
            "inputs": list(meta.get("inputs") or []), "outputs": list(meta.get("outputs") or [])}


def model_config(model: str, entry: CatalogueEntry) -> dict[str, Any]:
    """Enough of Triton's ModelConfig for clients that ask: name, platform, max batch size,
    inputs and outputs (``data_type`` ``TYPE_*``, ``dims`` without the batch dimension), and
    ``model_transaction_policy.decoupled`` (True for a model that answers in steps); a
    stateful model's ``sequence_batching`` (Oldest, its controls, idle timeout and state)."""
    meta = entry.metadata
    batchable = bool(meta.get("batchable", True))
    sequence = {"sequence_batching": meta["sequence_batching"]} if meta.get(
        "sequence_batching") else {}
    return {**sequence, "name": model, "platform": str(meta.get("platform", "pytorch")),
            "backend": SERVER_NAME,
            "max_batch_size": int(meta.get("max_batch_size", 0)) if batchable else 0,
            "input": [_config_tensor(t, batchable) for t in meta.get("inputs") or []],
            "output": [_config_tensor(t, batchable) for t in meta.get("outputs") or []],
            "model_transaction_policy": {"decoupled": is_decoupled(entry)}}


def is_decoupled(entry: CatalogueEntry) -> bool:
    """Whether the model answers in steps (the catalogue's ``decoupled``: Triton's decoupled
    transaction policy)."""
    return bool(entry.metadata.get("decoupled", False))


def _config_tensor(tensor: Mapping[str, Any], batchable: bool) -> dict[str, Any]:
    shape = list(tensor.get("shape") or [])
    dims = shape[1:] if batchable and shape else shape
    return {"name": tensor["name"], "data_type": "TYPE_" + _config_type(str(tensor["datatype"])),
            "dims": dims}


def _config_type(datatype: str) -> str:
    """v2 datatype → the suffix of Triton's ModelConfig ``TYPE_*`` name."""
    return {"BYTES": "STRING"}.get(datatype, datatype) if datatype in DATATYPES else datatype
