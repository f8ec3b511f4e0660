"""A Triton model configuration (``config.pbtxt``, protobuf text format of Triton's ModelConfig)
read into what a worker serves by: the model's inputs and outputs, its batching options, its
versions to serve.

Read as Triton reads it: the text must parse as a ModelConfig (an unknown field or a misspelt
enum is refused, naming its line), a ``name`` must be the model folder's, dims are each > 0 or -1,
tensor names are unique, preferred batch sizes fit ``max_batch_size``, a ``label_filename`` is a
file of the model folder. What Triton serves and asyncinfer does not (ensembles, a file model's
sequence batching or decoupled answers, optional, reshaped or shape-tensor inputs, batch inputs)
is refused naming the field, never silently ignored.

The mapping: ``max_batch_size`` (0: no batch dimension, each request runs alone), ``dims`` (one
row's shape), ``format`` (an input's FORMAT_NCHW / FORMAT_NHWC), ``label_filename`` (the output's
class labels); ``dynamic_batching``'s ``preferred_batch_size`` and ``max_queue_delay_microseconds``
(without ``dynamic_batching`` no delay is waited, though requests already queued still share a
batch), its ``default_queue_policy.max_queue_size`` (the model's queue bound),
``default_timeout_microseconds`` and ``priority_queue_policy`` (per level: Triton's level L goes to
Celery priority L's list, config/priority_policy.py); ``instance_group`` (the counts, summed: the
model's instances on the worker's device); ``response_cache.enable``; ``version_policy`` (which
version folders a worker loads at start; the others load by model control).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from asyncinfer.constants import PRIORITY_STEPS, level_of
from asyncinfer.models.base import INPUT_FORMATS, InputSpec, OutputSpec
from asyncinfer.models.proto import model_config_pb2
from asyncinfer.wire.model_versions import sorted_versions

__all__ = ["ConfigError", "TritonConfig", "read_config", "served_versions", "CONFIG_FILE"]

CONFIG_FILE = "config.pbtxt"
ModelConfig = model_config_pb2.ModelConfig
#: The renamed package of the messages (Triton's is ``inference``), left out of parse errors.
_PACKAGE = ModelConfig.DESCRIPTOR.file.package


class ConfigError(ValueError):
    """A model configuration that cannot be served: the message names the file and the rule."""


@dataclass(frozen=True)
class TritonConfig:
    """What a worker serves a repository model by (from its ``config.pbtxt``; empty parts where
    the model folder has none)."""

    path: Path
    platform: str = ""
    backend: str = ""
    default_model_filename: str = ""
    batch_dimension: bool = True
    inputs: dict[str, InputSpec] | None = None
    outputs: dict[str, OutputSpec] | None = None
    #: Model options it sets (config/model_options.py names), configuration overriding them.
    options: tuple[tuple[str, Any], ...] = ()
    #: The version policy: ("latest", n), ("all", 0) or ("specific", versions...).
    version_policy: tuple[Any, ...] = ("latest", 1)


def read_config(path: Path, model: str) -> TritonConfig:
    """Read ``path`` (the ``config.pbtxt`` of model folder ``model``).

    Raises:
        ConfigError: it does not parse as Triton's ModelConfig, or breaks one of its rules.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from None
    try:
        config = text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        where = f"line {exc.GetLine()}: " if exc.GetLine() else ""
        reason = str(exc).split(" : ", 1)[-1].replace(f"{_PACKAGE}.", "")
        raise ConfigError(f"{path}: {where}not a Triton model configuration: {reason}") from None
    return _checked(path, model, config)


def _checked(path: Path, model: str, config: Any) -> TritonConfig:
    def refuse(rule: str) -> ConfigError:
        return ConfigError(f"{path}: {rule}")

    if config.name and config.name != model:
        raise refuse(f"name '{config.name}' is not its model folder's name '{model}' "
                     f"(Triton requires them equal)")
    if config.max_batch_size < 0:
        raise refuse(f"max_batch_size must be >= 0, got {config.max_batch_size}")
    for field, what in (("ensemble_scheduling", "ensembles are not served"),
                        ("sequence_batching", "a file model's sequence batching is not served "
                                              "(a factory model declares it: docs/sequences.md)"),
                        ("batch_input", "batch inputs are not served"),
                        ("batch_output", "batch outputs are not served")):
        if _present(config, field):
            raise refuse(f"{field}: {what}")
    if config.model_transaction_policy.decoupled:
        raise refuse("model_transaction_policy.decoupled: a file model answers once (a decoupled "
                     "model is a factory model: docs/streaming.md)")
    batched = config.max_batch_size > 0
    inputs = {t.name: _input(refuse, t) for t in config.input} or None
    outputs = {t.name: _output(refuse, path.parent, t) for t in config.output} or None
    _unique(refuse, "input", [t.name for t in config.input])
    _unique(refuse, "output", [t.name for t in config.output])
    return TritonConfig(path=path, platform=config.platform, backend=config.backend,
                        default_model_filename=config.default_model_filename,
                        batch_dimension=batched, inputs=inputs, outputs=outputs,
                        options=tuple(_options(refuse, config).items()),
                        version_policy=_policy(refuse, config.version_policy))


def _present(config: Any, field: str) -> bool:
    """Whether ``field`` (a message, or a repeated field) is set."""
    if field in ("batch_input", "batch_output"):
        return len(getattr(config, field)) > 0
    return bool(config.HasField(field))


def _unique(refuse: Any, kind: str, names: list[str]) -> None:
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise refuse(f"{kind} names must be unique: {', '.join(sorted(seen))} repeated")


def _dims(refuse: Any, kind: str, name: str, dims: Iterable[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in dims)
    if not name:
        raise refuse(f"an {kind} has no name")
    if any(d == 0 or d < -1 for d in dims):
        raise refuse(f"{kind} '{name}': dims must each be > 0 or -1, got {list(dims)}")
    return dims


def _datatype(refuse: Any, kind: str, name: str, data_type: int) -> str:
    named = model_config_pb2.DataType.Name(data_type)
    if named == "TYPE_INVALID":
        raise refuse(f"{kind} '{name}': data_type must be set (TYPE_FP32, TYPE_INT64, ...)")
    return "BYTES" if named == "TYPE_STRING" else named.removeprefix("TYPE_")


def _input(refuse: Any, tensor: Any) -> InputSpec:
    for field in ("optional", "is_shape_tensor", "allow_ragged_batch"):
        if getattr(tensor, field):
            raise refuse(f"input '{tensor.name}': {field} is not served")
    if tensor.HasField("reshape"):
        raise refuse(f"input '{tensor.name}': reshape is not served")
    dims = _dims(refuse, "input", tensor.name, tensor.dims)
    layout = model_config_pb2.ModelInput.Format.Name(tensor.format)
    return InputSpec((_datatype(refuse, "input", tensor.name, tensor.data_type),), dims,
                     format=layout if layout in INPUT_FORMATS else "")


def _output(refuse: Any, folder: Path, tensor: Any) -> OutputSpec:
    if tensor.HasField("reshape") or tensor.is_shape_tensor:
        raise refuse(f"output '{tensor.name}': reshape and shape tensors are not served")
    dims = _dims(refuse, "output", tensor.name, tensor.dims)
    labels: tuple[str, ...] = ()
    if tensor.label_filename:
        label_file = folder / tensor.label_filename
        try:
            labels = tuple(line for line in label_file.read_text(encoding="utf-8").splitlines())
        except (OSError, UnicodeDecodeError) as exc:
            raise refuse(f"output '{tensor.name}': label_filename {label_file} cannot be read "
                         f"({exc.__class__.__name__})") from None
    return OutputSpec(_datatype(refuse, "output", tensor.name, tensor.data_type), dims, labels)


def _options(refuse: Any, config: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if config.max_batch_size > 0:
        options["max_batch_size"] = int(config.max_batch_size)
    if config.instance_group:
        options["instances"] = max(1, sum(max(1, g.count) for g in config.instance_group))
    if config.HasField("response_cache"):
        options["response_cache"] = bool(config.response_cache.enable)
    if not config.HasField("dynamic_batching"):
        options["max_delay_ms"] = 0.0
        return options
    batching = config.dynamic_batching
    sizes = sorted(set(batching.preferred_batch_size))
    if sizes and (sizes[0] < 1 or sizes[-1] > max(config.max_batch_size, 1)):
        raise refuse(f"dynamic_batching.preferred_batch_size {sizes} must be in "
                     f"1..max_batch_size ({config.max_batch_size})")
    if sizes:
        options["preferred_batch_sizes"] = sizes
    options["max_delay_ms"] = batching.max_queue_delay_microseconds / 1000.0
    default = batching.default_queue_policy
    if default.max_queue_size:
        options["max_queue_size"] = int(default.max_queue_size)
    levels: dict[str, dict[str, Any]] = {}
    if default.default_timeout_microseconds:
        for each in PRIORITY_STEPS:
            levels[str(each)] = {"default_timeout_s": default.default_timeout_microseconds / 1e6}
    shared: dict[str, int] = {}
    for level, policy in sorted(batching.priority_queue_policy.items()):
        step = str(level_of(int(level)))
        entry = {"max_queue_size": int(policy.max_queue_size),
                 "default_timeout_s": policy.default_timeout_microseconds / 1e6}
        if step in shared and levels[step] != entry:
            raise refuse(f"dynamic_batching.priority_queue_policy: levels {shared[step]} and "
                         f"{level} share Celery's priority list {step}, so they need one policy")
        levels[step], shared[step] = entry, int(level)
    if levels:
        options["priority_queue_policy"] = levels
    return options


def _policy(refuse: Any, policy: Any) -> tuple[Any, ...]:
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return ("all", 0)
    if which == "specific":
        versions = [str(v) for v in policy.specific.versions]
        if not versions or any(int(v) < 0 for v in versions):
            raise refuse("version_policy.specific needs versions >= 0")
        return ("specific", *versions)
    count = policy.latest.num_versions if which == "latest" else 1
    if count < 1:
        raise refuse("version_policy.latest.num_versions must be >= 1")
    return ("latest", int(count))


def served_versions(policy: tuple[Any, ...], versions: Iterable[str]) -> list[str]:
    """Of the version folders ``versions``, those the policy serves (Triton's: the latest one
    by default), in order."""
    ordered = sorted_versions(versions)
    kind = policy[0]
    if kind == "all":
        return ordered
    if kind == "specific":
        return [v for v in ordered if v in set(policy[1:])]
    return ordered[-int(policy[1]):]
