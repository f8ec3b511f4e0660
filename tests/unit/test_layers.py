"""The layers' arrows point one way: the engine imports neither Celery, kombu nor Redis, and no
module of the worker, the client, the tasks or the operations (read from the source, imports
inside functions included, followed through every asyncinfer module it reaches)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncinfer"
FORBIDDEN_LIBRARIES = {"celery", "kombu", "redis"}
FORBIDDEN_LAYERS = ("asyncinfer.worker", "asyncinfer.client", "asyncinfer.ops", "asyncinfer.tasks",
                    "asyncinfer.celery_app")


def _path_of(module: str) -> Path | None:
    parts = module.split(".")[1:]
    for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"),
                      PACKAGE.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reachable(start: str) -> dict[str, str]:
    """Every module imported from ``start`` on, each with the asyncinfer module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        module = todo.pop()
        path = _path_of(module)
        if path is None:
            continue
        for name in _imports(path):
            if name in seen:
                continue
            seen[name] = module
            if name.startswith("asyncinfer"):
                todo.append(name)
    return seen


def engine_modules() -> list[str]:
    return sorted(f"asyncinfer.engine.{p.stem}" for p in (PACKAGE / "engine").glob("*.py")
                  if p.stem != "__init__")


def test_the_walk_finds_what_a_worker_module_imports() -> None:
    found = reachable("asyncinfer.worker.intake.fast_consumer")
    assert "celery" in {name.split(".")[0] for name in found}
    assert "asyncinfer.engine.runner" in found


@pytest.mark.parametrize("module", engine_modules())
def test_the_engine_imports_no_celery_redis_or_upper_layer(module: str) -> None:
    found = reachable(module)
    libraries = {name: by for name, by in found.items() if name.split(".")[0] in FORBIDDEN_LIBRARIES}
    layers = {name: by for name, by in found.items() if name.startswith(FORBIDDEN_LAYERS)}
    assert libraries == {} and layers == {}, (module, libraries, layers)


def test_the_engine_has_its_modules() -> None:
    assert {"asyncinfer.engine.batcher", "asyncinfer.engine.runner", "asyncinfer.engine.device",
            "asyncinfer.engine.timer"} <= set(engine_modules())
