"""One name per thing: each name is imported from the module that defines it, read from the source.

- a module's ``__all__`` lists only names it defines (a def, a class, an assignment or an annotated
  assignment at module level), so no module re-exports another's names: only the public packages
  of :data:`PUBLIC` gather names from their modules (``from asyncinfer import Client``,
  ``from asyncinfer.models import Model``);
- every ``from asyncinfer.<module> import <name>`` (in the package, the tests, bench/ and the docs'
  Python blocks) names a module that defines ``<name>`` or holds it as a submodule, unless
  ``<module>`` is one of :data:`PUBLIC`: a name is not imported from a module that merely
  imported it itself.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncinfer"
#: The public packages, whose ``__init__`` gathers names defined in their modules.
PUBLIC = frozenset({"asyncinfer", "asyncinfer.client", "asyncinfer.config", "asyncinfer.models",
                    "asyncinfer.tracing"})
#: Where imports of asyncinfer's names are read besides the package (docs: their Python blocks).
IMPORTERS = ("tests", "bench", "examples")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def defined(tree: ast.Module) -> set[str]:
    """The names ``tree`` defines at module level (also inside a module-level ``if``, ``try`` or
    ``with``): by def, class, assignment or annotated assignment; imports define none."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(n.id for target in node.targets for n in ast.walk(target)
                             if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return names


def all_of(tree: ast.Module) -> list[str]:
    """The names in ``tree``'s ``__all__`` (none when it has none)."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            return [e.value for e in ast.walk(node.value)
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def imported(tree: ast.Module, module: str = "", is_package: bool = False,
             ) -> Iterator[tuple[int, str, str]]:
    """``(line, module, name)`` for each ``from asyncinfer... import name`` anywhere in ``tree``
    (a relative import read from ``module``)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
            base = ".".join([*parts, base] if base else parts)
        if base == "asyncinfer" or base.startswith("asyncinfer."):
            for alias in node.names:
                yield node.lineno, base, alias.name


def misnamed(modules: Mapping[str, str], importers: Mapping[str, str],
             packages: frozenset[str] = frozenset(), public: frozenset[str] = PUBLIC) -> list[str]:
    """What breaks the rules, one line each: ``modules`` (dotted name → source; ``packages`` the
    names among them that are packages) export, and ``importers`` (where → source) import."""
    trees = {name: ast.parse(source) for name, source in modules.items()}
    names = {name: defined(tree) for name, tree in trees.items()}
    broken = []
    for name, tree in trees.items():
        if name not in public:
            broken += [f"{name}: __all__ lists {n!r}, which it does not define"
                       for n in all_of(tree) if n not in names[name]]
    for where, source in importers.items():
        module = where if where in trees else ""
        for line, base, name in imported(ast.parse(source), module, module in packages):
            if base in public:
                continue
            if base not in names:
                broken.append(f"{where}:{line}: imports from {base}, which is no module")
            elif name not in names[base] and f"{base}.{name}" not in names:
                broken.append(f"{where}:{line}: imports {name!r} from {base}, which does not "
                              f"define it")
    return broken


@cache
def package_modules() -> tuple[dict[str, str], frozenset[str]]:
    """Every module's source by its dotted name, and the names that are packages."""
    modules, packages = {}, set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            packages.add(".".join(parts))
        modules[".".join(parts)] = path.read_text()
    return modules, frozenset(packages)


def importers() -> dict[str, str]:
    """Every source that imports asyncinfer's names: the package's modules (by name), the tests,
    bench/ and examples/ (by path), the docs' Python blocks (by page and block)."""
    found = dict(package_modules()[0])
    for folder in IMPORTERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[str(path.relative_to(ROOT))] = path.read_text()
    for page in DOCS:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            found[f"{page.relative_to(ROOT)} (Python block {i + 1})"] = block
    return found


# -- the check itself ---------------------------------------------------------------------------

def test_the_check_finds_a_reexport_and_an_import_from_it() -> None:
    modules = {
        "asyncinfer": "",
        "asyncinfer.a": "X = 1\ndef f(): ...\n",
        "asyncinfer.b": ("from asyncinfer.a import X, f\n"
                         "__all__ = ['X', 'g', 'Y', 'Z']\n"
                         "def g(): return f()\n"
                         "Y: int = 2\n"
                         "if X:\n    class Z: ...\n"),
        "asyncinfer.p": "from asyncinfer.a import X\n__all__ = ['X']\n",
        "asyncinfer.p.q": "",
    }
    users = {
        "asyncinfer.b": modules["asyncinfer.b"],
        "tests/t.py": ("from asyncinfer.b import X, g\n"
                       "from asyncinfer.a import X\n"
                       "from asyncinfer.p import X, q\n"
                       "def h():\n    from asyncinfer.gone import W\n"),
        "asyncinfer.p.q": "from . import X\nfrom .. import b\n",
    }
    assert misnamed(modules, users, frozenset({"asyncinfer.p"}), frozenset({"asyncinfer.p"})) == [
        "asyncinfer.b: __all__ lists 'X', which it does not define",
        "tests/t.py:1: imports 'X' from asyncinfer.b, which does not define it",
        "tests/t.py:5: imports from asyncinfer.gone, which is no module",
    ]
    # without the public package, its gathering is a re-export too
    found = misnamed(modules, users, frozenset({"asyncinfer.p"}), frozenset())
    assert "asyncinfer.p: __all__ lists 'X', which it does not define" in found
    assert "asyncinfer.p.q:1: imports 'X' from asyncinfer.p, which does not define it" in found


def test_the_sources_are_all_read() -> None:
    modules, packages = package_modules()
    assert {"asyncinfer.broker.take", "asyncinfer.gateway.service"} <= set(modules)
    assert {"asyncinfer", "asyncinfer.worker.requests"} <= packages
    assert PUBLIC <= packages
    sources = importers()
    assert "tests/unit/test_reexports.py" in sources
    assert any(where.startswith("README.md (Python block") for where in sources)


# -- the whole tree -----------------------------------------------------------------------------

def test_each_name_is_imported_from_the_module_that_defines_it() -> None:
    modules, packages = package_modules()
    broken = misnamed(modules, importers(), packages)
    assert broken == [], "\n".join(broken)
