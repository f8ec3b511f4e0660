"""The Lua scripts the package runs in Redis, one file each beside this module (``<name>.lua``),
so that a script is read, diffed and reviewed as a script (as dramatiq keeps its
``brokers/redis/*.lua``).

Each file opens with a comment that gives its contract (KEYS, ARGV, what it returns) and the module
that runs it. :func:`script` reads a file once and returns its text without that opening comment:
what Redis is sent (and hashes for EVALSHA) is the script alone, as it was when the scripts were
Python strings. Imports nothing of Redis: any layer may name a script.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

__all__ = ["script", "names"]


@cache
def script(name: str) -> str:
    """The text of ``<name>.lua`` without its opening comment (read once)."""
    text = files(__name__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith("--"):
        start += 1
    return "".join(lines[start:])


def names() -> list[str]:
    """The names of every script here, sorted."""
    return sorted(entry.name[:-len(".lua")] for entry in files(__name__).iterdir()
                  if entry.name.endswith(".lua"))
