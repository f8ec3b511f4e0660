"""A model's v2 metadata and the part of Triton's ModelConfig the gateway answers, from its
catalogue entry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.wire.datatypes import DATATYPES

__all__ = ["SERVER_NAME", "model_metadata", "model_config", "is_decoupled", "label_filename"]

#: The gateway's name (ServerMetadata's) and the backend its model configs name.
SERVER_NAME = "asyncinfer"


def model_metadata(model: str, entry: CatalogueEntry) -> dict[str, Any]:
    """The v2 model metadata (``name``, ``versions``, ``platform``, ``inputs``, ``outputs``)."""
    meta = entry.metadata
    return {"name": model, "versions": entry.versions,
            "platform": str(meta.get("platform", "pytorch")),
            "inputs": [_metadata_tensor(t) for t in meta.get("inputs") or []],
            "outputs": [_metadata_tensor(t) for t in meta.get("outputs") or []]}


def model_config(model: str, entry: CatalogueEntry) -> dict[str, Any]:
    """Enough of Triton's ModelConfig for clients that ask: name, platform, max batch size,
    inputs (``data_type`` ``TYPE_*``, ``dims`` without the batch dimension, ``format``
    ``FORMAT_*``, as Triton's JSON always has it) and outputs (the same but ``format``; an output
    with labels has ``label_filename`` and, beside it, the ``labels``), and
    ``model_transaction_policy.decoupled`` (True for a model that answers in steps); a
    stateful model's ``sequence_batching`` (Oldest, its controls, idle timeout and state); a
    batching model's ``dynamic_batching`` (``preferred_batch_size``,
    ``max_queue_delay_microseconds``) and its ``instance_group`` (instances on the device a
    worker runs it on: ``KIND_CPU`` when every host's device is a CPU, else ``KIND_GPU``), as
    the model announced them."""
    meta = entry.metadata
    batchable = bool(meta.get("batchable", True))
    sequence = {"sequence_batching": meta["sequence_batching"]} if meta.get(
        "sequence_batching") else {}
    batching = {"dynamic_batching": dict(meta["dynamic_batching"])} if batchable and meta.get(
        "dynamic_batching") else {}
    kind = "KIND_CPU" if all(h.device in ("", "cpu") for h in entry.hosts) else "KIND_GPU"
    instances = {"instance_group": [{"kind": kind, **g} for g in meta["instance_group"]]} if \
        meta.get("instance_group") else {}
    return {**sequence, **batching, **instances, "name": model,
            "platform": str(meta.get("platform", "pytorch")), "backend": SERVER_NAME,
            "max_batch_size": int(meta.get("max_batch_size", 0)) if batchable else 0,
            "input": [{**_config_tensor(t, batchable), "format": _format(t)}
                      for t in meta.get("inputs") or []],
            "output": [_config_tensor(t, batchable) for t in meta.get("outputs") or []],
            "model_transaction_policy": {"decoupled": is_decoupled(entry)}}


def is_decoupled(entry: CatalogueEntry) -> bool:
    """Whether the model answers in steps (the catalogue's ``decoupled``: Triton's decoupled
    transaction policy)."""
    return bool(entry.metadata.get("decoupled", False))


def _metadata_tensor(tensor: Mapping[str, Any]) -> dict[str, Any]:
    """A v2 metadata tensor: name, datatype and shape (the catalogue's other keys are the
    config's)."""
    return {k: tensor[k] for k in ("name", "datatype", "shape") if k in tensor}


def _format(tensor: Mapping[str, Any]) -> str:
    """An input's Triton ``format``: the ``FORMAT_*`` its model declared (models/base.py
    InputSpec checks it), else ``FORMAT_NONE``."""
    return str(tensor.get("format") or "FORMAT_NONE")


def _config_tensor(tensor: Mapping[str, Any], batchable: bool) -> dict[str, Any]:
    shape = list(tensor.get("shape") or [])
    dims = shape[1:] if batchable and shape else shape
    config = {"name": tensor["name"], "data_type": "TYPE_" + _config_type(str(tensor["datatype"])),
              "dims": dims}
    if tensor.get("labels"):  # no file: the model declares them (OutputSpec.labels)
        config.update(label_filename=label_filename(str(tensor["name"])),
                      labels=list(tensor["labels"]))
    return config


def label_filename(output: str) -> str:
    """The ``label_filename`` an output with labels shows in its config: the labels travel in the
    catalogue, not in a file; the name says whose they are."""
    return f"{output}_labels.txt"


def _config_type(datatype: str) -> str:
    """v2 datatype → the suffix of Triton's ModelConfig ``TYPE_*`` name."""
    return {"BYTES": "STRING"}.get(datatype, datatype) if datatype in DATATYPES else datatype
