"""A Prometheus registry of a process' own: what the default registry would serve (the process'
CPU and memory, the platform, Python's collections), to which a worker or a gateway adds its
families. A registry per worker or gateway keeps two of them in one process (tests) apart."""

from __future__ import annotations

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry

__all__ = ["process_registry"]


def process_registry() -> CollectorRegistry:
    """A new registry serving the process' ``process_*`` and ``python_*`` series."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry
