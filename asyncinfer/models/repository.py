"""The model folder (``ASYNCINFER_MODEL_DIR``, ``--model-dir``): flat model files and Triton's model
repository layout side by side, read into registry entries.

Flat files, as before: ``NAME.pt`` (TorchScript), ``NAME.pt2`` (``torch.export``), ``NAME.onnx``
(onnxruntime), and ``NAME@V.<suffix>`` for version V of NAME.

Triton's layout: a folder ``NAME/`` holding an optional ``config.pbtxt`` (models/triton_config.py)
and version folders ``1/``, ``2/``, … each holding the model file — ``model.pt``
(``pytorch_libtorch``), ``model.pt2`` (``torch_export``), ``model.onnx`` (``onnxruntime_onnx``),
``model.py`` (backend ``asyncinfer``: a factory model's code, models/version_code.py), or the
config's ``default_model_filename``. The config's platform (or backend) says which file a
version folder holds; without one, the one model file it holds says. The latest served version is
registered as ``NAME``, the others as ``NAME@V``; :attr:`Entry.served` says which the version
policy serves at start (the rest load by model control: ``asyncinfer models load NAME --version V``).

A model folder the rules refuse (a config that does not parse, a version folder without its file,
a platform asyncinfer does not serve) still registers its name: loading it fails with the reason,
naming the file and the rule, so the worker serves the others and lists this one as UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Model
from asyncinfer.models.files import FileModel
from asyncinfer.models.onnx_file import OnnxModel
from asyncinfer.models.triton_config import (
    CONFIG_FILE,
    ConfigError,
    TritonConfig,
    read_config,
    served_versions,
)
from asyncinfer.models.version_code import version_model
from asyncinfer.wire.model_versions import latest, split_key, version_key

__all__ = ["Entry", "scan", "FILE_SUFFIXES", "PLATFORMS"]

#: Model file suffix → the platform it is (Triton's names; ``torch_export`` is asyncinfer's).
FILE_SUFFIXES = {".pt": "pytorch_libtorch", ".pt2": "torch_export", ".onnx": "onnxruntime_onnx"}
#: Platform → the model file of a version folder (Triton's default file names; ``asyncinfer``: a
#: factory model's code, models/version_code.py).
PLATFORMS = {"pytorch_libtorch": "model.pt", "torch_export": "model.pt2",
             "onnxruntime_onnx": "model.onnx", "asyncinfer": "model.py"}
#: Triton's backend names → the platform they serve here.
_BACKENDS = {"pytorch": "pytorch_libtorch", "onnxruntime": "onnxruntime_onnx",
             "asyncinfer": "asyncinfer"}


@dataclass(frozen=True)
class Entry:
    """One registry entry of the model folder: ``key`` (``NAME`` or ``NAME@V``), its factory,
    whether it is served at start, and its version."""

    key: str
    factory: Callable[[], Model]
    served: bool = True
    #: The version it is ("": the model's own, "1" unless it declares another).
    version: str = ""


def scan(folder: Path) -> list[Entry]:
    """The registry entries of ``folder``: its flat model files and its model folders."""
    entries: list[Entry] = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_file() and path.suffix in FILE_SUFFIXES:
            entries.append(Entry(path.stem, _flat(path)))
        elif path.is_dir() and _is_model_folder(path):
            entries.extend(_model_folder(path))
    return entries


def _is_model_folder(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or any(p.is_dir() and p.name.isdigit()
                                                 for p in path.iterdir())


def _flat(path: Path) -> Callable[[], Model]:
    name = split_key(path.stem)[0]

    def create() -> Model:
        if path.suffix == ".onnx":
            return OnnxModel(name, path)
        return FileModel(name, path)

    return create


def _model_folder(folder: Path) -> list[Entry]:
    name = folder.name
    try:
        if "@" in name or "." in name:
            raise ConfigError(f"{folder}: a model folder's name must have no '@' or '.'")
        config = read_config(folder / CONFIG_FILE, name) if (folder / CONFIG_FILE).is_file() \
            else None
        versions = {p.name: p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()}
        if not versions:
            raise ConfigError(f"{folder}: no version folder (1/, 2/, ...) holding the model file")
        files = {v: _model_file(folder / v, config) for v in versions}
    except ConfigError as exc:
        return [Entry(name, _refused(exc))]
    policy = config.version_policy if config is not None else ("latest", 1)
    served = set(served_versions(policy, files))
    if not served:
        return [Entry(name, _refused(ConfigError(
            f"{folder / CONFIG_FILE}: version_policy {policy[0]} serves none of the version "
            f"folders {', '.join(sorted(files))}")))]
    top = latest(served)
    return [Entry(name if v == top else version_key(name, v),
                  _version_factory(name, v, path, config), served=v in served, version=v)
            for v, path in files.items()]


def _model_file(version: Path, config: TritonConfig | None) -> Path:
    """The model file of a version folder, as the config's platform (or backend, or default file
    name) says, else the one model file it holds."""
    if config is not None and config.default_model_filename:
        named = config.default_model_filename
        if Path(named).name != named or named in (".", ".."):
            raise ConfigError(f"{config.path}: default_model_filename {named!r} must be a file "
                              f"name in the version folder, not a path")
        path = version / named
        if not path.is_file():
            raise ConfigError(f"{version}: no default_model_filename {path.name}")
        if path.suffix not in (*FILE_SUFFIXES, ".py"):
            raise ConfigError(f"{path}: not a model file asyncinfer serves (suffixes "
                              f"{', '.join(FILE_SUFFIXES)}, .py)")
        return path
    platform = _platform(config)
    if platform:
        path = version / PLATFORMS[platform]
        if not path.is_file():
            raise ConfigError(f"{version}: no {path.name} (the file of platform {platform})")
        return path
    found = [version / f for f in PLATFORMS.values() if (version / f).is_file()]
    if len(found) != 1:
        held = ", ".join(p.name for p in found) or "none of them"
        raise ConfigError(f"{version}: a version folder holds one of "
                          f"{', '.join(PLATFORMS.values())} (it holds {held}); or name the "
                          f"platform in config.pbtxt")
    return found[0]


def _platform(config: TritonConfig | None) -> str:
    if config is None or not (config.platform or config.backend):
        return ""
    platform = config.platform or _BACKENDS.get(config.backend, "")
    if platform not in PLATFORMS:
        served = ", ".join(f"platform {p}" for p in PLATFORMS)
        given = (f"platform '{config.platform}'" if config.platform
                 else f"backend '{config.backend}'")
        raise ConfigError(f"{config.path}: {given} is not served ({served}; backends "
                          f"{', '.join(_BACKENDS)})")
    if config.platform and config.backend and _BACKENDS.get(config.backend) != platform:
        raise ConfigError(f"{config.path}: backend '{config.backend}' does not serve platform "
                          f"'{config.platform}'")
    return platform


def _version_factory(name: str, version: str, path: Path,
                     config: TritonConfig | None) -> Callable[[], Model]:
    def create() -> Model:
        inputs = config.inputs if config is not None else None
        outputs = config.outputs if config is not None else None
        model: Model
        if path.suffix == ".py":
            model = version_model(name, version, path)
            if config is not None and config.inputs is not None:
                model.inputs = config.inputs
            if config is not None and config.outputs is not None:
                model.outputs = config.outputs
        elif path.suffix == ".onnx":
            model = OnnxModel(name, path, inputs, outputs,
                              batch_dimension=config is None or config.batch_dimension)
        else:
            model = FileModel(name, path, inputs, outputs)
            if config is not None:
                model.batch_dimension = config.batch_dimension
        model.version = version
        if config is not None:
            model.options = ModelOptions().merged(dict(config.options))
        return model

    return create


def _refused(error: ConfigError) -> Callable[[], Model]:
    def create() -> Model:
        raise error

    return create
