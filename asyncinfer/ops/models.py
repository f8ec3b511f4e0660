"""What ``asyncinfer models`` shows: the model catalogue (broker/catalogue.py) as a table."""

from __future__ import annotations

from collections.abc import Mapping

from asyncinfer.broker.catalogue import CatalogueEntry

__all__ = ["format_models"]


def _tensors(items: object) -> str:
    if not isinstance(items, list) or not items:
        return "any"
    return ", ".join(f"{t['name']} {t['datatype']}{t['shape']}" for t in items)


def format_models(entries: Mapping[str, CatalogueEntry]) -> str:
    """One line per model: versions, ready, max batch size, inputs → outputs, workers (devices)."""
    if not entries:
        return "(no model announced: start a worker, e.g. asyncinfer worker --models mlp)"
    lines = [f"{'MODEL':16} {'VERSIONS':8} {'READY':5} {'BATCH':>5}  {'INPUTS -> OUTPUTS':48} WORKERS"]
    for name, e in entries.items():
        meta = e.metadata
        io = f"{_tensors(meta.get('inputs'))} -> {_tensors(meta.get('outputs'))}"
        workers = ", ".join(f"{h.worker} ({h.device})" for h in e.hosts) or "-"
        lines.append(f"{name:16} {','.join(e.versions):8} {'yes' if e.ready else 'no':5} "
                     f"{meta.get('max_batch_size', '?')!s:>5}  {io:48} {workers}")
    return "\n".join(lines)
