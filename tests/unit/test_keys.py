"""Every Redis key and channel name lives in asyncinfer/wire/keys.py: no other module spells one."""

from __future__ import annotations

import ast
from pathlib import Path

from asyncinfer.wire import keys

PACKAGE = Path(keys.__file__).parent
#: How the names in keys.py begin (or are); a string literal elsewhere that begins so spells a key.
PREFIXES = ("asyncinfer:", keys.RESULT_KEY_PREFIX)
NAMES = (keys.UNACKED_KEY, keys.UNACKED_INDEX_KEY)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_no_module_but_keys_spells_a_redis_key() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "keys.py"
             for line, text in _string_literals(path) if text.startswith(PREFIXES) or text in NAMES]
    assert not found, "Redis key names outside keys.py:\n" + "\n".join(found)
