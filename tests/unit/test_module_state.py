"""No mutable state at module level in the package: a worker's state lives in its
:class:`~asyncinfer.worker.worker.Worker`, passed to what needs it, so that two workers can live in
one process and a unit test can build one.

Read from the source (every module-level assignment, ``global`` statements anywhere) and from the
imported modules (what each of those names holds). A name in capitals is a constant: it may hold a
dict or a list of pure data, but nothing in the package may change it.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import enum
import importlib
import re
import threading
import weakref
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[2] / "asyncinfer"

#: The module state the package keeps, each with why it cannot be an object's.
ALLOWED = {
    ("asyncinfer.celery_app", "app"):
        "Celery's `-A asyncinfer` finds the app here; it holds configuration, not a worker's state",
    ("asyncinfer.ops.benchmark.baseline", "app"): "the in-process limit's app: Celery finds tasks by module",
    ("asyncinfer.models.files", "_weights_only_lock"):
        "guards torch.load's process-wide safe-globals list, which is torch's state, not ours",
    ("asyncinfer.worker.worker", "_making"):
        "guards the making of an app's one worker where Celery's worker_init made none",
    ("asyncinfer.wire.clock", "BROKER_CLOCK"):
        "this host's clock's offset from the broker's: a fact of the host, like its clock, shared "
        "by every worker and client of the process",
    ("asyncinfer.broker.clock_skew", "CLOCK_FOLLOWER"):
        "keeps BROKER_CLOCK measured: one thread a process, for the process' one clock",
    ("asyncinfer.wire.messages", "_random"):
        "os.urandom's bytes read ahead for request IDs: the process's randomness, as os.urandom's "
        "own; a forked child drops it",
}

#: Modules not imported here: generated code and the command's entry point.
SKIPPED = re.compile(r"(\.proto\.|__main__$)")

_MUTABLE = (list, dict, set, bytearray, collections.deque, weakref.WeakKeyDictionary,
            weakref.WeakValueDictionary, weakref.WeakSet)
_LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Event, threading.Condition,
          threading.local)
_MUTATORS = ("append", "extend", "insert", "update", "add", "pop", "popitem", "clear",
             "setdefault", "remove", "discard", "sort", "reverse")


def _modules() -> list[tuple[str, ast.Module]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        if not SKIPPED.search(name):
            found.append((name, ast.parse(path.read_text(), str(path))))
    return found


def _module_names(tree: ast.Module) -> list[str]:
    """Names bound by module-level assignments (inside module-level ``if`` and ``try`` too)."""
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Assign):
                names.extend(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and node.value is not None \
                    and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return [n for n in names if n != "__all__"]


def _is_constant(name: str) -> bool:
    return name.lstrip("_").isupper()


def _kind(value: Any) -> str | None:
    """What makes ``value`` state, or None."""
    if isinstance(value, _MUTABLE):
        return type(value).__name__
    if isinstance(value, _LOCKS):
        return "a lock or event"
    cls = type(value)
    if isinstance(value, (type, enum.Enum)) or callable(value) and not hasattr(value, "__dict__"):
        return None
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:  # type: ignore[union-attr]
        return None
    if cls.__module__.split(".")[0] in {"asyncinfer", "celery", "kombu", "prometheus_client", "redis"}:
        return f"a {cls.__name__}"
    return None


def test_no_module_keeps_mutable_state() -> None:
    found = []
    for name, tree in _modules():
        module = importlib.import_module(name)
        for var in dict.fromkeys(_module_names(tree)):
            kind = _kind(getattr(module, var, None))
            if kind is None or (name, var) in ALLOWED:
                continue
            if _is_constant(var) and kind in {c.__name__ for c in (list, dict, set)}:
                continue  # a constant of pure data (see the next test)
            found.append(f"{name}.{var}: {kind}")
    assert found == [], ("module-level state: give it to the object that owns it (the worker's "
                         "lives in asyncinfer.worker.worker.Worker)")


def test_no_function_rebinds_module_state() -> None:
    found = [f"{name}:{node.lineno} global {', '.join(node.names)}"
             for name, tree in _modules() for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert found == []


def test_constants_are_never_changed() -> None:
    constants = {var for _, tree in _modules() for var in _module_names(tree) if _is_constant(var)}
    changed = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                target = next((t.value for t in targets if isinstance(t, ast.Subscript)), None)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _MUTATORS:
                target = node.func.value
            if isinstance(target, ast.Name) and target.id in constants:
                changed.append(f"{name}:{node.lineno} changes {target.id}")
    assert changed == []


def test_the_allowlist_names_only_what_exists() -> None:
    names = {(name, var) for name, tree in _modules() for var in _module_names(tree)}
    assert set(ALLOWED) - names == set()
