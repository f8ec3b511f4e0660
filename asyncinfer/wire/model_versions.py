"""A model's versions: version ``v`` of model ``m`` is registered as ``m@v`` (a factory entry
``m@2=pkg.mod:factory``, or a file ``m@2.pt`` / ``m@2.pt2`` of the model folder); the plain ``m``
is the version its instance declares (``Model.version``, "1" unless it says). Every version of
``m`` takes its requests from the one queue ``infer.m``; a request names its version in its
parameters (``model_version``), else it runs on the latest version the worker hosts (the
highest number)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SEP", "PARAMETER", "split_key", "version_key", "latest", "sorted_versions",
           "version_order"]

SEP = "@"
#: The request parameter that names the version a request wants.
PARAMETER = "model_version"


def split_key(key: str) -> tuple[str, str]:
    """``m@2`` → ``("m", "2")``; ``m`` → ``("m", "")``."""
    name, _, version = key.partition(SEP)
    return name, version


def version_key(name: str, version: str) -> str:
    """The registry name of ``version`` of model ``name`` (``name`` itself without a version)."""
    return f"{name}{SEP}{version}" if version else name


def version_order(version: str) -> tuple[int, int | str]:
    """A sort key of versions: numbers by their value (``2`` before ``10``), then the others."""
    return (0, int(version)) if version.isdigit() else (1, version)


def sorted_versions(versions: Iterable[str]) -> list[str]:
    """Versions in order, numbers by their value (``2`` before ``10``)."""
    return sorted(set(versions), key=version_order)


def latest(versions: Iterable[str]) -> str:
    """The highest version ("" for none)."""
    ordered = sorted_versions(versions)
    return ordered[-1] if ordered else ""
