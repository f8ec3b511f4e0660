"""A factory model's version from the model folder: ``NAME/V/model.py`` (backend ``asyncinfer``),
the code of version V of model NAME, imported when a worker loads that version.

The file defines ``create()`` returning a :class:`~asyncinfer.models.Model`, or one ``Model``
subclass. Each version's file is imported as a module of its own (``asyncinfer_models.NAME.vV``),
so a new version's code loads hot beside the running one's, by model control
(``asyncinfer models load NAME --version V``), no restart and no configuration change. Only files
the operator put in the model folder are imported: a request or a control command names a model
and a version, never code.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

from asyncinfer.models.base import Model

__all__ = ["version_model"]


def version_model(name: str, version: str, path: Path) -> Model:
    """Version ``version`` of model ``name`` from its ``model.py`` at ``path``.

    Raises:
        ValueError: the file cannot be imported (its error in one line), or defines neither
            ``create()`` nor one ``Model`` subclass, or ``create()`` returns no ``Model``.
    """
    what = f"model '{name}' version {version}: {path}"
    module_name = f"asyncinfer_models.{name}.v{version}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # what the module's classes name as theirs
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the file's own error, in one line
        sys.modules.pop(module_name, None)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"{what}: importing it raised {type(exc).__name__}: {first}") from None
    factory = getattr(module, "create", None)
    if factory is None:
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if issubclass(c, Model) and c is not Model and c.__module__ == module_name]
        if len(classes) != 1:
            raise ValueError(f"{what}: defines neither create() nor one Model subclass "
                             f"(it defines {len(classes)})")
        factory = classes[0]
    model = factory()
    if not isinstance(model, Model):
        raise ValueError(f"{what}: create() returned {type(model).__name__}, not a Model")
    model.name, model.version = name, version
    return model
