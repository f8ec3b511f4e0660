"""A model author imports everything from ``asyncinfer.models``: every public name of
models/base.py, and every name the user-model examples of the README and docs/ use."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

import asyncinfer.models as models
from asyncinfer.models import base

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _model_examples() -> list[tuple[str, ast.Module]]:
    """Each python block of the pages that defines a model (a class deriving from ``Model``)."""
    found = []
    for page in PAGES:
        for i, block in enumerate(_BLOCK.findall(page.read_text())):
            tree = ast.parse(block)
            if any(isinstance(node, ast.ClassDef) and
                   any(isinstance(b, ast.Name) and b.id == "Model" for b in node.bases)
                   for node in ast.walk(tree)):
                found.append((f"{page.name}#{i}", tree))
    return found


EXAMPLES = _model_examples()


def test_every_public_name_of_the_base_module_is_exported() -> None:
    for name in base.__all__:
        assert name in models.__all__, name
        assert getattr(models, name) is getattr(base, name)


def test_every_exported_name_resolves() -> None:
    assert sorted(models.__all__) == sorted(set(models.__all__))
    for name in models.__all__:
        assert getattr(models, name) is not None, name


def test_the_docs_have_user_model_examples() -> None:
    # Given the pages, Then the streaming page's two examples are found (the test checks something)
    assert len(EXAMPLES) >= 2, [where for where, _ in EXAMPLES]


@pytest.mark.parametrize(("where", "tree"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_a_user_model_example_imports_what_it_uses_from_asyncinfer_models(
        where: str, tree: ast.Module) -> None:
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imported[alias.asname or alias.name] = node.module or ""
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    # every name of ours it uses (those a model author finds in asyncinfer.models)...
    ours = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in models.__all__}
    assert "Model" in ours
    for name in sorted(ours - defined - set(dir(builtins))):
        # ...is imported from asyncinfer.models, and that import works
        assert imported.get(name) == "asyncinfer.models", f"{where}: {name} is not imported from " \
                                                          f"asyncinfer.models"
        namespace: dict[str, object] = {}
        exec(f"from asyncinfer.models import {name}", namespace)  # noqa: S102 - our own docs
        assert namespace[name] is getattr(models, name)
