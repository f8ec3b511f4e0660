"""The layers' arrows point one way, read from the source (every import: at module level, behind
``TYPE_CHECKING`` and inside functions), and the folders say the layers.

- base < wire < broker < config < client, engine < policy < worker < gateway < ops: a module
  imports its own layer and those below it, never one above; client and engine are siblings and
  import neither each other;
- no circle between modules, not even one that only ``TYPE_CHECKING`` or a function-level import
  hides; and none between the rooms of any folder (its loose modules and its subfolders, a
  subfolder standing for everything beneath it), so a folder's parts stand one above another;
- every module of the package sits in a layer, by its top-level folder: the package root holds at
  most :data:`ROOT_MODULES` modules, each placed by name in :data:`PLACES`;
- the engine imports neither Celery, kombu nor Redis, and no module of the worker, the client, the
  tasks or the operations (followed through every asyncinfer module it reaches).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncinfer"
FORBIDDEN_LIBRARIES = {"celery", "kombu", "redis"}
FORBIDDEN_LAYERS = ("asyncinfer.worker", "asyncinfer.client", "asyncinfer.ops", "asyncinfer.tasks",
                    "asyncinfer.celery_app")
#: The most modules the package root may hold: the public API and what every layer needs.
ROOT_MODULES = 8

#: The layers, lowest first; layers of one rank are siblings (neither imports the other).
LAYERS: dict[str, int] = {
    "base": 0,  # names and small tools everything shares
    "wire": 1,  # the contract on the wire and in Redis: messages, payloads, key names
    "broker": 2,  # everything that speaks to Redis and kombu, with its Lua scripts
    "config": 3,  # the settings, the Celery app built from them, tracing
    "client": 4,  # the producers' side
    "engine": 4,  # batching on a device: no Celery, no Redis
    "policy": 5,  # Celery's task options as the worker reads them (retries, time limits, budget)
    "worker": 6,  # the Celery worker: its consumers, pipeline, output, its tasks
    "gateway": 7,  # the HTTP/gRPC front, a client of the fleet
    "ops": 8,  # the CLI, ``asyncinfer up``, the benchmark
}

#: The layer of each top-level module and package of asyncinfer (a package's modules are in its
#: layer), and why it sits there.
PLACES: dict[str, str] = {
    # the package itself: ``from asyncinfer import Client`` (lazily) and the Celery app
    "asyncinfer": "client",
    "asyncinfer.__main__": "ops",  # ``python -m asyncinfer``: the CLI
    "asyncinfer.errors": "base",  # one exception hierarchy, raised everywhere
    "asyncinfer.constants": "base",  # task and queue names, priority levels
    "asyncinfer.backoff": "base",  # the wait after failures in a row, for every loop
    "asyncinfer.metrics_registry": "base",  # a Prometheus registry with the process' own series
    "asyncinfer.supervision": "base",  # child processes and vital threads
    "asyncinfer.wire": "wire",
    "asyncinfer.broker": "broker",
    "asyncinfer.store": "broker",  # the tensor store (fsspec): what lies beside Redis
    "asyncinfer.config": "config",
    "asyncinfer.celery_app": "config",  # the app, built from the settings: ``celery -A``'s noun
    # OpenTelemetry when asked for (None when off): what the client, the worker and the
    # gateway record their spans with, from the settings and the wire's trace context
    "asyncinfer.tracing": "config",
    "asyncinfer.client": "client",
    "asyncinfer.engine": "engine",
    "asyncinfer.models": "engine",  # what the engine runs: no Celery, no Redis
    "asyncinfer.policy": "policy",
    "asyncinfer.worker": "worker",
    "asyncinfer.tasks": "worker",  # the Celery tasks a worker runs
    "asyncinfer.gateway": "gateway",
    "asyncinfer.ops": "ops",
}


@dataclass(frozen=True)
class Import:
    """One import of an asyncinfer module, as written in ``source``."""

    source: str
    target: str
    line: int
    #: ``module`` (at import), ``typing`` (behind ``if TYPE_CHECKING``) or ``function``.
    kind: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target} ({self.kind})"


def module_paths() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_in(module: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """The asyncinfer modules ``source`` imports: ``from a.b import c`` names ``a.b.c`` when that
    is a module, else ``a.b``; a name that is no module is cut back to the module holding it."""
    found: list[Import] = []

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def add(name: str, line: int, kind: str) -> None:
        target = resolve(name)
        if target is not None and target != module:
            found.append(Import(module, target, line, kind))

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno, kind)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")[:len(module.split(".")) - child.level + is_package]
                    base = ".".join([*parts, base] if base else parts)
                for alias in child.names:
                    add(f"{base}.{alias.name}", child.lineno, kind)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                visit(child, kind)

    visit(ast.parse(source), "module")
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def import_graph() -> list[Import]:
    paths = module_paths()
    known = set(paths)
    return [found for module, path in paths.items()
            for found in imports_in(module, path.read_text(), known, path.name == "__init__.py")]


def layer_of(module: str) -> str | None:
    """The layer :data:`PLACES` gives ``module`` (its own entry, else its top-level package's)."""
    if module in PLACES:
        return PLACES[module]
    top = ".".join(module.split(".")[:2])
    return PLACES.get(top) if top != "asyncinfer" else None


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


# -- the walk itself ----------------------------------------------------------------------------

def test_the_walk_sees_imports_at_every_level() -> None:
    source = """
from typing import TYPE_CHECKING
import asyncinfer.wire.keys
from asyncinfer.wire import envelope
from asyncinfer.errors import InvalidRequest
from . import sibling
if TYPE_CHECKING:
    from asyncinfer.config.settings import Settings
else:
    from asyncinfer.constants import TASK_NAME
def f():
    from asyncinfer.broker.take import Taker
"""
    known = {"asyncinfer.wire.keys", "asyncinfer.wire", "asyncinfer.wire.envelope", "asyncinfer.errors",
             "asyncinfer.config.settings", "asyncinfer.constants", "asyncinfer.broker.take",
             "asyncinfer.client.sibling", "asyncinfer.client.here"}
    found = {(e.target, e.kind) for e in imports_in("asyncinfer.client.here", source, known)}
    assert found == {("asyncinfer.wire.keys", "module"), ("asyncinfer.wire.envelope", "module"),
                     ("asyncinfer.errors", "module"), ("asyncinfer.client.sibling", "module"),
                     ("asyncinfer.config.settings", "typing"), ("asyncinfer.constants", "module"),
                     ("asyncinfer.broker.take", "function")}


def test_the_circle_finder_finds_a_circle() -> None:
    edges = [Import("a", "b", 1, "module"), Import("b", "c", 1, "typing"),
             Import("c", "a", 1, "function"), Import("c", "d", 1, "module")]
    assert circles(edges) == [["a", "b", "c"]]


# -- the whole package --------------------------------------------------------------------------

def test_every_module_sits_in_a_layer() -> None:
    unplaced = sorted(m for m in module_paths() if layer_of(m) is None)
    assert unplaced == [], f"place these in PLACES (tests/test_layers.py): {unplaced}"
    assert set(PLACES.values()) <= set(LAYERS)
    stale = sorted(name for name in PLACES if name not in module_paths())
    assert stale == [], f"PLACES names modules that are gone: {stale}"


def test_no_import_circles() -> None:
    edges = import_graph()
    found = circles(edges)
    shown = [sorted({str(e) for e in edges if e.source in c and e.target in c}) for c in found]
    assert found == [], "\n".join("circle:\n  " + "\n  ".join(s) for s in shown)


def test_imports_point_down_only() -> None:
    upward = []
    for e in import_graph():
        source, target = layer_of(e.source), layer_of(e.target)
        assert source is not None and target is not None, e
        if source != target and LAYERS[target] >= LAYERS[source]:
            upward.append(f"{e}: {source} imports {target}")
    assert upward == [], "\n".join(upward)


def test_the_graph_holds_what_the_package_holds() -> None:
    edges = {(e.source, e.target, e.kind) for e in import_graph()}
    assert ("asyncinfer.client.client", "asyncinfer.client.sender", "module") in edges
    assert ("asyncinfer.worker.worker", "asyncinfer.worker.consumers.consumer", "typing") in edges
    assert ("asyncinfer.ops.cli", "asyncinfer.ops.dead", "function") in edges


def room_of(module: str, folder: str) -> str | None:
    """The room of ``folder`` (a dotted package) that holds ``module``: the subfolder it lies
    under, or the module itself when it is loose in ``folder``; None when it is outside."""
    if not module.startswith(folder + "."):
        return None
    return f"{folder}.{module[len(folder) + 1:].split('.')[0]}"


def folders() -> list[str]:
    return sorted(m for m, path in module_paths().items() if path.name == "__init__.py")


def room_circles(folder: str, edges: list[Import]) -> list[list[str]]:
    """The circles between the rooms of ``folder``."""
    inside = []
    for e in edges:
        source, target = room_of(e.source, folder), room_of(e.target, folder)
        if source and target and source != target:
            inside.append(Import(source, target, e.line, e.kind))
    return circles(inside)


def test_the_room_finder_sees_a_circle_through_a_subfolder() -> None:
    edges = [Import("p.a", "p.sub.x", 1, "module"), Import("p.sub.y", "p.a", 1, "function"),
             Import("p.b", "p.a", 1, "module")]
    assert room_circles("p", edges) == [["p.a", "p.sub"]]
    assert room_circles("p.sub", edges) == []


@pytest.mark.parametrize("folder", folders())
def test_no_circle_between_the_rooms_of_a_folder(folder: str) -> None:
    edges = import_graph()
    found = room_circles(folder, edges)
    shown = [sorted({str(e) for e in edges if room_of(e.source, folder) in c
                     and room_of(e.target, folder) in c
                     and room_of(e.source, folder) != room_of(e.target, folder)}) for c in found]
    assert found == [], "\n".join("rooms in a circle:\n  " + "\n  ".join(s) for s in shown)


def test_the_root_holds_only_the_public_nouns() -> None:
    loose = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(loose) <= ROOT_MODULES, loose
    assert all(f"asyncinfer.{name}" in PLACES for name in loose if name != "__init__"), loose


# -- the engine: no Celery, Redis or upper layer, followed through every module it reaches ------

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
    found = reachable("asyncinfer.worker.consumers.fast_consumer")
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
