"""A factory named in a load command (``asyncinfer models load m --version 2 --factory
mymodels:make_v2``): checked against ``ASYNCINFER_LOADABLE_FACTORIES``
(config/loadable_factories.py), imported, and registered as ``m@2``, for worker/model_control.py
to load like any registered version while the others serve on.

The module is imported from the worker's working directory as at start
(:func:`~asyncinfer.models.registry.import_from_working_dir`); one imported before that lacks the
attribute now (``make_v2`` written into the same file since the worker started) is reloaded once
(:func:`importlib.reload`) before the load gives up. Every failure is one line
(:class:`~asyncinfer.models.registry.FactoryError`, or :class:`FactoryRefused`), and a version
whose load failed does not stay registered (:func:`forget`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, MutableMapping

from asyncinfer.config.loadable_factories import allows, loadable_patterns, refusal
from asyncinfer.models.base import Model
from asyncinfer.models.registry import FactoryError, load_factory
from asyncinfer.wire.model_versions import version_key
from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["FactoryRefused", "register_factory", "import_factory", "forget", "check_allowed"]

Factory = Callable[[], Model]


class FactoryRefused(ValueError):
    """A command's factory that the worker will not register: its module is not allowed
    (the message names ``ASYNCINFER_LOADABLE_FACTORIES``), or the version is registered here
    otherwise."""


def check_allowed(runtime: WorkerRuntime, path: str) -> None:
    """Nothing when the worker's settings allow the module of ``path``; else FactoryRefused."""
    settings = runtime.settings
    patterns = loadable_patterns(settings.loadable_factories, settings.model_factories)
    module = path.partition(":")[0].strip()
    if not allows(patterns, module):
        raise FactoryRefused(refusal(path, patterns, configured=bool(settings.loadable_factories)))


def import_factory(path: str, key: str) -> Factory:
    """The factory ``path`` (``pkg.mod:attr``) names, imported for model ``key``; a module
    imported before that lacks the attribute is reloaded once first.

    Raises:
        FactoryError: malformed, the module not found or its import (or reload) raised, no such
            attribute, not callable — one line naming ``key`` and ``path``.
    """
    module_name, _, attr = path.partition(":")
    module = sys.modules.get(module_name) if module_name and attr else None
    if module_name and attr and module is None:
        importlib.invalidate_caches()  # a module file written since the worker started
    elif module is not None and not _has(module, attr):
        try:
            importlib.reload(module)
        except Exception as exc:  # noqa: BLE001 - the module's own error, in one line
            first = (str(exc).strip().splitlines() or [""])[0]
            raise FactoryError(f"model factory '{key}' ({path}): reloading module "
                               f"'{module_name}' raised {type(exc).__name__}: {first}") from None
    return load_factory(path, key)


def _has(target: object, attr: str) -> bool:
    for part in attr.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def _versioned(factory: Factory, name: str, version: str) -> Factory:
    """``factory`` whose instances are named ``name`` (and are ``version``, where given)."""
    def create() -> Model:
        model = factory()
        model.name = name
        if version:
            model.version = version
        return model

    return create


def register_factory(runtime: WorkerRuntime, registered: MutableMapping[str, str], model: str,
                     version: str, path: str) -> bool:
    """Register the factory ``path`` as ``model@version`` (``model`` without a version) on
    ``runtime``; ``registered``: the worker's record of what commands registered (key → path).
    True when registered now (:func:`forget` it if its load fails); False when that factory
    has that version loaded here already (the load changes nothing).

    Raises:
        FactoryRefused: the module is not allowed; the version is registered here otherwise
            (a factory entry, a model file, a built-in) or loaded from another factory.
        FactoryError: its import failed (:func:`import_factory`).
        ValueError: not a model name the registry takes.
    """
    path = path.strip()
    key = version_key(model, version)
    what = f"model '{model}'" + (f" version '{version}'" if version else "")
    _check_format(path, key)
    check_allowed(runtime, path)
    known = registered.get(key)
    if known is None and key in runtime.loadable():
        raise FactoryRefused(f"{what} is registered on this worker already (a built-in, "
                             f"ASYNCINFER_MODEL_FACTORIES or ASYNCINFER_MODEL_DIR): load it "
                             f"without a factory")
    if key in runtime.by_model():
        if known == path:
            return False
        raise FactoryRefused(f"{what} is loaded on this worker from factory {known}: unload it "
                             f"first to load it from {path}")
    factory = import_factory(path, key)
    runtime.registry.register(key, _versioned(factory, model, version))
    registered[key] = path
    return True


def _check_format(path: str, key: str) -> None:
    """FactoryError (the registry's words) for a ``path`` that is no ``pkg.mod:attr``, before
    anything is imported."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        load_factory(path, key)  # raises its FactoryError before importing anything


def forget(runtime: WorkerRuntime, registered: MutableMapping[str, str], key: str) -> None:
    """``key`` registered by a command whose load failed: registered no more."""
    registered.pop(key, None)
    runtime.registry.unregister(key)

