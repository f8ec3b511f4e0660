"""The model folder in Triton's layout (models/repository.py, models/triton_config.py): what a
config.pbtxt sets, which versions serve, and what is refused, naming the file and the rule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import InputSpec, OutputSpec
from asyncinfer.models.onnx_file import OnnxModel, providers_for
from asyncinfer.models.registry import Registry
from asyncinfer.models.triton_config import ConfigError, read_config, served_versions
from tests.support.model_repository import build_repository, scaled

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repo"))


def test_each_model_serves_its_latest_served_version_by_its_name(repository: Path) -> None:
    registry = Registry.from_config([], str(repository))
    # onnx serves every version (version_policy all); the others their latest, as Triton does
    assert {"scripted", "exported", "onnx", "onnx@1"} <= set(registry.served())
    assert registry.version_of("onnx") == "2" and registry.version_of("scripted") == "1"
    rows = [[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -1.0, 2.0]]
    for key, output, factor in (("scripted", "output", 2.0), ("exported", "output", 3.0),
                                ("onnx@1", "y", 5.0), ("onnx", "y", 7.0)):
        model = registry.create(key)
        model.load(CPU)
        answer = model.forward({"x": torch.tensor(rows)})
        assert answer[output].tolist() == scaled(rows, factor), key


def test_the_config_sets_signature_batching_and_instances(repository: Path) -> None:
    model = Registry.from_config([], str(repository)).create("scripted")
    assert model.name == "scripted" and model.version == "1"
    assert model.options == ModelOptions(max_batch_size=8, preferred_batch_sizes=(4, 8),
                                         max_delay_ms=2.0, instances=1)
    assert model.inputs == {"x": InputSpec(("FP32",), (4,))}
    assert model.outputs == {"output": OutputSpec("FP32", (4,))}
    exported = Registry.from_config([], str(repository)).create("exported")
    assert exported.options.max_delay_ms == 0.0 and exported.options.max_batch_size == 16


def _config(tmp_path: Path, text: str, name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(text)
    return folder / "config.pbtxt"


def test_queue_policy_labels_and_no_batching(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "labels.txt").write_text("cat\ndog\n")
    path = _config(tmp_path, '''
max_batch_size: 0
input [ { name: "img" data_type: TYPE_UINT8 format: FORMAT_NCHW dims: [ 3, -1, -1 ] } ]
output [ { name: "p" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "labels.txt" } ]
dynamic_batching {
  default_queue_policy { max_queue_size: 100 default_timeout_microseconds: 2000000 }
  priority_levels: 2
  priority_queue_policy { key: 1 value: { max_queue_size: 10 } }
}
response_cache { enable: true }
instance_group [ { count: 2 }, { count: 1 kind: KIND_GPU } ]
''')
    config = read_config(path, "m")
    assert not config.batch_dimension
    assert config.inputs == {"img": InputSpec(("UINT8",), (3, -1, -1), format="FORMAT_NCHW")}
    assert config.outputs == {"p": OutputSpec("FP32", (2,), ("cat", "dog"))}
    options = ModelOptions().merged(dict(config.options))
    assert options.max_queue_size == 100 and options.instances == 3 and options.response_cache
    policy = dict(options.priority_queue_policy)
    # Triton's level 1 is Celery priority 1: kombu's list 0; the default timeout on the others
    assert policy[0].max_queue_size == 10 and policy[0].default_timeout_s == 0.0
    assert policy[3].default_timeout_s == 2.0 and policy[9].default_timeout_s == 2.0


@pytest.mark.parametrize(("text", "rule"), [
    ('name: "other"', "name 'other' is not its model folder's name 'm' (Triton requires them equal)"),
    ("max_batch_size: -1", "max_batch_size must be >= 0, got -1"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 0 ] } ]',
     "input 'x': dims must each be > 0 or -1, got [0]"),
    ('input [ { name: "x" dims: [ 4 ] } ]', "input 'x': data_type must be set"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }, '
     '{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]', "input names must be unique: x repeated"),
    ("max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 8 ] }",
     "dynamic_batching.preferred_batch_size [8] must be in 1..max_batch_size (4)"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] optional: true } ]',
     "input 'x': optional is not served"),
    ('ensemble_scheduling { step [ { model_name: "a" } ] }',
     "ensemble_scheduling: ensembles are not served"),
    ("model_transaction_policy { decoupled: true }", "model_transaction_policy.decoupled"),
    ('output [ { name: "p" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "none.txt" } ]',
     "output 'p': label_filename"),
    ('input [ { name: "x" data_typ: TYPE_FP32 } ]',
     'line 1: not a Triton model configuration: Message type "ModelInput" has no field named '
     '"data_typ".'),
    ("version_policy: { latest { num_versions: 0 } }", "num_versions must be >= 1"),
])
def test_a_config_triton_refuses_is_refused_naming_file_and_rule(tmp_path: Path, text: str,
                                                                 rule: str) -> None:
    path = _config(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        read_config(path, "m")
    assert str(info.value).startswith(f"{path}: ") and rule in str(info.value)


def test_version_policies() -> None:
    versions = ["1", "2", "10", "3"]
    assert served_versions(("latest", 1), versions) == ["10"]
    assert served_versions(("latest", 2), versions) == ["3", "10"]
    assert served_versions(("all", 0), versions) == ["1", "2", "3", "10"]
    assert served_versions(("specific", "2", "7"), versions) == ["2"]


def test_a_refused_model_folder_registers_and_fails_its_own_load(tmp_path: Path) -> None:
    build_repository(tmp_path)
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.pt").write_bytes(b"")
    (tmp_path / "broken" / "config.pbtxt").write_text('platform: "tensorrt_plan"')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.pbtxt").write_text("")
    (tmp_path / "two" / "1").mkdir(parents=True)
    for file in ("model.pt", "model.onnx"):
        (tmp_path / "two" / "1" / file).write_bytes(b"")
    registry = Registry.from_config([], str(tmp_path))
    assert {"broken", "empty", "two", "scripted"} <= set(registry.served())
    reasons = {}
    for name in ("broken", "empty", "two"):
        with pytest.raises(ConfigError) as info:
            registry.create(name)
        reasons[name] = str(info.value)
    assert reasons["broken"] == (f"{tmp_path / 'broken' / 'config.pbtxt'}: platform "
                                 f"'tensorrt_plan' is not served (platform pytorch_libtorch, "
                                 f"platform torch_export, platform onnxruntime_onnx, platform "
                                 f"asyncinfer; backends pytorch, onnxruntime, asyncinfer)")
    assert reasons["empty"] == (f"{tmp_path / 'empty'}: no version folder (1/, 2/, ...) holding "
                                f"the model file")
    assert reasons["two"].startswith(f"{tmp_path / 'two' / '1'}: a version folder holds one of "
                                     f"model.pt, model.pt2, model.onnx, model.py (it holds model.pt, "
                                     f"model.onnx)")
    registry.create("scripted")  # the others are untouched


def test_flat_onnx_file_takes_its_signature_from_the_graph(repository: Path,
                                                           tmp_path: Path) -> None:
    (tmp_path / "flat.onnx").write_bytes((repository / "onnx" / "1" / "model.onnx").read_bytes())
    model = Registry.from_config([], str(tmp_path)).create("flat")
    assert isinstance(model, OnnxModel)
    model.load(CPU)
    assert model.inputs == {"x": InputSpec(("FP32",), (4,))}
    assert model.outputs == {"y": OutputSpec("FP32", (4,))}
    assert model.metadata(ModelOptions())["platform"] == "onnxruntime_onnx"


def test_an_onnx_config_that_disagrees_with_the_graph_is_refused(repository: Path,
                                                                 tmp_path: Path) -> None:
    graph = repository / "onnx" / "1" / "model.onnx"
    model = OnnxModel("m", graph, inputs={"x": InputSpec(("INT64",), (4,))})
    with pytest.raises(ValueError, match=r"config.pbtxt's input 'x' is INT64, the graph's is FP32"):
        model.load(CPU)
    model = OnnxModel("m", graph, inputs={"z": InputSpec(("FP32",), (4,))})
    with pytest.raises(ValueError, match=r"config.pbtxt's input 'z' is not a input of the graph"):
        model.load(CPU)
    model = OnnxModel("m", graph, inputs={"x": InputSpec(("FP32",), (5,))})
    with pytest.raises(ValueError, match=r"has dims \[5\], the graph's are \[4\]"):
        model.load(CPU)
    (tmp_path / "junk.onnx").write_bytes(b"not a graph")
    with pytest.raises(ValueError, match=r"junk.onnx cannot be loaded by onnxruntime: "):
        OnnxModel("junk", tmp_path / "junk.onnx").load(CPU)


def test_execution_provider_follows_the_device() -> None:
    assert providers_for(CPU, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert providers_for(torch.device("cuda:1"), ["CUDAExecutionProvider", "CPUExecutionProvider"]
                         ) == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    with pytest.raises(ValueError, match=r"device npu:0 needs onnxruntime's CANNExecutionProvider.*"
                                         r"install onnxruntime-cann"):
        providers_for(SimpleNamespace(type="npu", index=0), ["CPUExecutionProvider"])


VERSION_CODE = '''
from asyncinfer.models import InputSpec, Model, OutputSpec


class Times(Model):
    inputs = {{"x": InputSpec(("FP32",), (-1,))}}
    outputs = {{"y": OutputSpec("FP32", (-1,))}}

    def forward(self, batch):
        return {{"y": batch["x"] * {factor}}}
'''


def _version(folder: Path, version: str, text: str) -> None:
    (folder / "m" / version).mkdir(parents=True, exist_ok=True)
    (folder / "m" / version / "model.py").write_text(text)


def test_a_factory_version_from_the_model_folder_and_one_added_later(tmp_path: Path) -> None:
    _version(tmp_path, "1", VERSION_CODE.format(factor=2))
    registry = Registry.from_config([], str(tmp_path))
    model = registry.create("m")
    assert (model.name, model.version) == ("m", "1")
    assert model.forward({"x": torch.ones(1, 2)})["y"].tolist() == [[2.0, 2.0]]
    # When version 2's code is added while version 1 serves as "m", and the folder read again
    _version(tmp_path, "2", VERSION_CODE.format(factor=3) + "\ndef create():\n    return Times()\n")
    registry.add_dir(tmp_path)
    # Then "m" is still version 1 (a worker may run it) and version 2 registers as m@2
    assert registry.version_of("m") == "1" and "m@2" in registry.names()
    assert "m@2" not in registry.served()
    two = registry.create("m@2")
    assert two.version == "2" and two.forward({"x": torch.ones(1, 2)})["y"].tolist() == [[3.0, 3.0]]
    # and a fresh registry (a new worker) serves the latest as "m"
    fresh = Registry.from_config([], str(tmp_path))
    assert fresh.version_of("m") == "2" and "m@1" in fresh.names() and "m@1" not in fresh.served()


@pytest.mark.parametrize(("code", "reason"), [
    ("raise RuntimeError('no weights')\n", "importing it raised RuntimeError: no weights"),
    ("x = 1\n", "defines neither create() nor one Model subclass (it defines 0)"),
    ("def create():\n    return 42\n", "create() returned int, not a Model"),
])
def test_a_version_code_that_cannot_serve_names_itself(tmp_path: Path, code: str,
                                                       reason: str) -> None:
    _version(tmp_path, "1", code)
    with pytest.raises(ValueError) as info:
        Registry.from_config([], str(tmp_path)).create("m")
    assert str(info.value) == f"model 'm' version 1: {tmp_path / 'm' / '1' / 'model.py'}: {reason}"


def test_a_default_model_filename_that_is_a_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "outside.pt").write_bytes(b"")
    config = tmp_path / "m" / "config.pbtxt"
    config.write_text('default_model_filename: "../../outside.pt"')
    with pytest.raises(ConfigError) as info:
        Registry.from_config([], str(tmp_path)).create("m")
    assert str(info.value) == (f"{config}: default_model_filename '../../outside.pt' must be a "
                               f"file name in the version folder, not a path")
