"""A factory named in a load command: which modules model control may import
(``ASYNCINFER_LOADABLE_FACTORIES``: config/loadable_factories.py), and the worker's import,
reload and registration of it (worker/factory_loads.py) on a real runtime."""

from __future__ import annotations

import dataclasses
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncinfer.config.loadable_factories import (
    allows,
    loadable_patterns,
    parse_patterns,
    refusal,
)
from asyncinfer.config.settings import Settings
from asyncinfer.models.registry import FactoryError
from asyncinfer.worker.factory_loads import (
    FactoryRefused,
    forget,
    import_factory,
    register_factory,
)
from asyncinfer.worker.runtime import WorkerRuntime

pytestmark = pytest.mark.timeout(60)

PLUS = '''
from asyncinfer.models import Model


class Plus(Model):
    def __init__(self, n):
        self.n = n

    def forward(self, batch):
        return {"output": batch["input"] + self.n}


def make_v1():
    return Plus(1.0)
'''
MAKE_V2 = '''

def make_v2():
    return Plus(2.0)
'''


# -- the rule --------------------------------------------------------------------------------

def test_a_module_is_allowed_by_name_or_by_its_package() -> None:
    assert allows(["mymodels"], "mymodels")
    assert not allows(["mymodels"], "mymodels.v2")  # a module alone: not what is under it
    assert not allows(["mymodels"], "mymodelsx")
    assert allows(["mymodels.*"], "mymodels") and allows(["mymodels.*"], "mymodels.a.b")
    assert not allows(["mymodels.*"], "mymodelsx") and not allows(["mymodels.*"], "other.mymodels")
    assert allows(["other", "*"], "anything.at.all")
    assert not allows([], "mymodels")


def test_unset_allows_the_modules_of_the_configured_factories_each_alone() -> None:
    configured = ("m=mymodels:make", "m@2=mymodels:make_v2", "n=pkg.sub:Cls.make")
    assert loadable_patterns((), configured) == ("mymodels", "pkg.sub")
    assert loadable_patterns((), ()) == ()
    # set: it replaces the default; 'none' allows nothing even beside configured factories
    assert loadable_patterns(("other.*",), configured) == ("other.*",)
    assert loadable_patterns(("none",), configured) == ()


def test_the_settings_entries_are_checked_naming_the_setting() -> None:
    assert parse_patterns([" a ", "b.c.*", "", "*"]) == ("a", "b.c.*", "*")
    with pytest.raises(ValueError) as bad:
        parse_patterns(["my-models"])
    assert str(bad.value) == ("ASYNCINFER_LOADABLE_FACTORIES entry 'my-models' must be a module "
                              "name (mymodels), a package and what is under it (mymodels.*), '*' "
                              "or 'none'")
    with pytest.raises(ValueError, match="'mymodels.\\*\\*' must be a module name"):
        parse_patterns(["mymodels.**"])
    with pytest.raises(ValueError) as alone:
        parse_patterns(["none", "a"])
    assert str(alone.value) == "ASYNCINFER_LOADABLE_FACTORIES: 'none' stands alone, got 'none,a'"
    with pytest.raises(ValueError, match="ASYNCINFER_LOADABLE_FACTORIES entry 'a:b'"):
        Settings.from_env(environ={"ASYNCINFER_LOADABLE_FACTORIES": "mymodels,a:b"})
    assert Settings.from_env(environ={"ASYNCINFER_LOADABLE_FACTORIES": "a, b.*"}
                             ).loadable_factories == ("a", "b.*")


def test_the_refusal_names_the_module_the_setting_and_what_it_allows() -> None:
    tail = ("; importing a module runs its code and any producer on the broker can send this "
            "command, so a worker imports only the modules its operator lists there")
    assert refusal("evil:make", ["mymodels"], configured=False) == (
        "factory evil:make: module 'evil' is not allowed by ASYNCINFER_LOADABLE_FACTORIES on this "
        "worker (unset, it allows the modules of ASYNCINFER_MODEL_FACTORIES: mymodels)" + tail)
    assert refusal("evil.x:make", ["a.*", "b"], configured=True) == (
        "factory evil.x:make: module 'evil.x' is not allowed by ASYNCINFER_LOADABLE_FACTORIES on "
        "this worker (it allows: a.*, b)" + tail)
    assert "(it allows: no module)" in refusal("m:f", [], configured=True)


# -- on a runtime ------------------------------------------------------------------------------

@pytest.fixture()
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A factory module of its own name (``make_v1`` only) in a folder on the import path."""
    name = f"hot_{uuid.uuid4().hex[:12]}"
    path = tmp_path / f"{name}.py"
    path.write_text(PLUS)
    monkeypatch.syspath_prepend(str(tmp_path))
    # no bytecode cache: a file rewritten within the same second is read again
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    try:
        yield name, path
    finally:
        sys.modules.pop(name, None)


def _runtime(name: str, **settings: object) -> WorkerRuntime:
    """A CPU runtime serving ``m`` (``m=<name>:make_v1`` configured)."""
    base = dataclasses.replace(Settings.from_env(device="cpu"), models=("m",), metrics_port=0,
                               model_factories=(f"m={name}:make_v1",), model_dir="")
    runtime = WorkerRuntime(dataclasses.replace(base, **settings))
    runtime.load(["m"])
    return runtime


def _run(runtime: WorkerRuntime, version: str = "") -> tuple[float, str | None]:
    request: dict = {"model": "m", "inputs": [{"name": "input", "shape": [1, 1],
                                               "datatype": "FP32", "data": [10.0]}]}
    if version:
        request["parameters"] = {"model_version": version}
    out = runtime.infer("r", request, worker="w")
    return out["outputs"][0]["data"][0], out["parameters"].get("model_version")


def test_a_new_version_written_into_the_loaded_module_is_reloaded_registered_and_loaded(
        module: tuple[str, Path]) -> None:
    name, path = module
    runtime = _runtime(name)
    record: dict[str, str] = {}
    try:
        # Given m served from the module, which has no make_v2 when the worker started
        assert name in sys.modules and _run(runtime) == (11.0, None)
        # When make_v2 is added to the same file and a command names it
        path.write_text(PLUS + MAKE_V2)
        assert register_factory(runtime, record, "m", "2", f"{name}:make_v2") is True
        # Then the module was reloaded once, version 2 is registered and loads beside version 1
        assert record == {"m@2": f"{name}:make_v2"} and "m@2" in runtime.registry.names()
        assert runtime.load_one("m@2")
        assert runtime.versions_of("m") == {"m": "1", "m@2": "2"}
        assert runtime.by_model()["m@2"].model.name == "m"
        assert _run(runtime) == (12.0, "2") and _run(runtime, "1") == (11.0, "1")
        # The same command again changes nothing; another factory for the loaded version is refused
        assert register_factory(runtime, record, "m", "2", f"{name}:make_v2") is False
        with pytest.raises(FactoryRefused) as other:
            register_factory(runtime, record, "m", "2", f"{name}:make_v1")
        assert str(other.value) == (f"model 'm' version '2' is loaded on this worker from factory "
                                    f"{name}:make_v2: unload it first to load it from "
                                    f"{name}:make_v1")
    finally:
        runtime.close()


def test_a_module_not_allowed_is_refused_before_it_is_imported(
        module: tuple[str, Path], tmp_path: Path) -> None:
    name, _ = module
    evil = f"evil_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{evil}.py").write_text(PLUS.replace("make_v1", "make"))
    runtime = _runtime(name)
    try:
        with pytest.raises(FactoryRefused) as refused:
            register_factory(runtime, {}, "m", "2", f"{evil}:make")
        assert str(refused.value).startswith(
            f"factory {evil}:make: module '{evil}' is not allowed by ASYNCINFER_LOADABLE_FACTORIES "
            f"on this worker (unset, it allows the modules of ASYNCINFER_MODEL_FACTORIES: {name});")
        assert evil not in sys.modules and "m@2" not in runtime.registry.names()
    finally:
        runtime.close()
    # allowed by the setting, it registers
    runtime = _runtime(name, loadable_factories=(evil,))
    try:
        assert register_factory(runtime, {}, "m", "2", f"{evil}:make")
        assert "m@2" in runtime.registry.names()
    finally:
        runtime.close()
        sys.modules.pop(evil, None)
    # 'none': not even the configured module
    runtime = _runtime(name, loadable_factories=("none",))
    try:
        with pytest.raises(FactoryRefused, match=r"\(it allows: no module\)"):
            register_factory(runtime, {}, "m", "2", f"{name}:make_v1")
    finally:
        runtime.close()


def test_failures_are_one_line_and_leave_nothing_registered(module: tuple[str, Path]) -> None:
    name, path = module
    runtime = _runtime(name, loadable_factories=(name, "absent_module_here"))
    record: dict[str, str] = {}
    try:
        # no such attribute, even after the reload
        with pytest.raises(FactoryError) as missing:
            register_factory(runtime, record, "m", "2", f"{name}:make_v2")
        assert str(missing.value) == (f"model factory 'm@2' ({name}:make_v2): module '{name}' "
                                      f"has no attribute 'make_v2'")
        # the module's file broken since: its reload's error, in one line
        path.write_text(PLUS + "\nraise RuntimeError('no weights here')\n")
        with pytest.raises(FactoryError) as broken:
            import_factory(f"{name}:make_v2", "m@2")
        assert str(broken.value) == (f"model factory 'm@2' ({name}:make_v2): reloading module "
                                     f"'{name}' raised RuntimeError: no weights here")
        with pytest.raises(FactoryError, match="cannot import module 'absent_module_here'"):
            register_factory(runtime, record, "m", "2", "absent_module_here:make")
        with pytest.raises(FactoryError, match="must look like 'package.module:factory'"):
            register_factory(runtime, record, "m", "2", name)
        # a version registered otherwise is not replaced by a command's factory
        with pytest.raises(FactoryRefused) as registered:
            register_factory(runtime, record, "m", "", f"{name}:make_v1")
        assert str(registered.value).startswith("model 'm' is registered on this worker already")
        assert record == {} and "m@2" not in runtime.registry.names()
        # a registered version whose load failed is forgotten
        path.write_text(PLUS + MAKE_V2)
        assert register_factory(runtime, record, "m", "3", f"{name}:make_v2")
        forget(runtime, record, "m@3")
        assert record == {} and "m@3" not in runtime.registry.names()
        assert "m@3" not in runtime.loadable()
    finally:
        runtime.close()
