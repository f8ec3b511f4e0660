"""Every Lua script of the package is a file in asyncinfer/broker/scripts/, named by one module, and
compiles (Lua 5.1, Redis' version); no module holds a script in a Python string."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from asyncinfer.broker import scripts
from asyncinfer.broker.scripts import names, script

PACKAGE = Path(scripts.__file__).resolve().parents[2]
FOLDER = Path(scripts.__file__).resolve().parent


def _named_scripts() -> dict[str, list[str]]:
    """Each name given to ``script("...")`` in the package, with the modules that give it."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "script" and len(node.args) == 1
                    and isinstance(node.args[0], ast.Constant)):
                found.setdefault(node.args[0].value, []).append(str(path.relative_to(PACKAGE)))
    return found


def test_no_module_holds_a_lua_script() -> None:
    inline = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                    if "redis.call(" in path.read_text() or "redis.pcall(" in path.read_text())
    assert inline == [], f"move these modules' Lua into asyncinfer/broker/scripts/*.lua: {inline}"


def test_every_script_file_is_used_and_every_used_script_is_a_file() -> None:
    used = _named_scripts()
    assert sorted(used) == names(), (sorted(set(names()) - set(used)), sorted(set(used) - set(names())))
    assert len(names()) >= 20  # the glob sees the folder (an empty one would pass the line above)


@pytest.mark.parametrize("name", names())
def test_each_file_opens_with_its_contract(name: str) -> None:
    text = (FOLDER / f"{name}.lua").read_text(encoding="utf-8")
    header = text[:len(text) - len(script(name))]
    assert header.startswith("-- ") and header.endswith("\n"), name
    assert header.count("\n") >= 1 and all(line.startswith("--") for line in header.splitlines())


@pytest.mark.parametrize("name", names())
def test_what_redis_is_sent_is_the_script_alone(name: str) -> None:
    body = script(name)
    assert body.startswith("\n") and body.endswith("\n"), name
    assert not body.lstrip("\n").startswith("--"), name  # the header is not sent
    assert "redis." in body, name


def test_a_script_is_read_once() -> None:
    assert script("publish") is script("publish")


@pytest.mark.parametrize("name", names())
def test_a_script_is_plain_text(name: str) -> None:
    """No tab or other control byte a reader cannot see: Lua's escapes ('\\t', '\\25') say them."""
    text = (FOLDER / f"{name}.lua").read_text(encoding="utf-8")
    assert [c for c in text if ord(c) < 32 and c != "\n"] == [], name


@pytest.mark.parametrize("name", names())
def test_each_script_compiles(name: str) -> None:
    lua51 = pytest.importorskip("lupa.lua51")
    runtime = lua51.LuaRuntime()
    compile_error = runtime.eval("function(code) local f, err = loadstring(code) return err end")
    assert compile_error(script(name)) is None
    assert compile_error("x = = 1") is not None  # the check can fail
