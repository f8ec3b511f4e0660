"""Which factories model control may import: ``ASYNCINFER_LOADABLE_FACTORIES``.

A load command may name a factory (``asyncinfer models load m --version 2 --factory
mymodels:make_v2``) that the worker imports, registers and loads. The command comes through the
broker, which every producer can write to, and importing a module runs its code; so a worker
imports a command's factory only from a module its operator allowed — as Celery's own remote
control imports the ``modules`` of a ``pool_restart`` only where ``worker_pool_restarts`` is on.

The setting lists modules (``mymodels``: that module alone), packages (``mymodels.*``: the package
and every module under it), ``*`` (any module) or ``none``. Unset, the modules of the factories
the worker was configured with (``ASYNCINFER_MODEL_FACTORIES``) are allowed, each alone: a new
version written beside the old one loads, and nothing else does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["SETTING", "ANY", "NONE", "parse_patterns", "loadable_patterns", "allows", "module_of",
           "refusal"]

#: The environment variable of the rule (named in every refusal).
SETTING = "ASYNCINFER_LOADABLE_FACTORIES"
#: Any module at all.
ANY = "*"
#: No module: a factory named in a command is always refused.
NONE = "none"

_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\.\*)?$")


def parse_patterns(entries: Iterable[str]) -> tuple[str, ...]:
    """The setting's entries, checked: ValueError naming the setting and the rule for one that
    is no module name, ``pkg.*``, ``*`` or ``none`` (``none`` alone)."""
    patterns = tuple(e.strip() for e in entries if e.strip())
    for pattern in patterns:
        if pattern not in (ANY, NONE) and not _PATTERN.match(pattern):
            raise ValueError(f"{SETTING} entry {pattern!r} must be a module name (mymodels), a "
                             f"package and what is under it (mymodels.*), '*' or 'none'")
    if NONE in patterns and len(patterns) > 1:
        raise ValueError(f"{SETTING}: 'none' stands alone, got {','.join(patterns)!r}")
    return patterns


def module_of(path: str) -> str:
    """``pkg.mod:attr`` → ``pkg.mod``."""
    return path.partition(":")[0].strip()


def loadable_patterns(loadable_factories: Iterable[str],
                      model_factories: Iterable[str]) -> tuple[str, ...]:
    """What the worker allows: the setting's patterns, else (unset) the modules of the
    configured factory entries (``name=pkg.mod:factory``), each alone; () for ``none``."""
    patterns = parse_patterns(loadable_factories)
    if not patterns:
        modules = (module_of(entry.partition("=")[2]) for entry in model_factories)
        return tuple(dict.fromkeys(m for m in modules if m))
    return () if patterns == (NONE,) else patterns


def allows(patterns: Iterable[str], module: str) -> bool:
    """Whether ``module`` is one of ``patterns`` (see the module documentation)."""
    for pattern in patterns:
        if pattern == ANY or pattern == module:
            return True
        if pattern.endswith(".*"):
            package = pattern[:-2]
            if module == package or module.startswith(f"{package}."):
                return True
    return False


def refusal(path: str, patterns: Iterable[str], configured: bool) -> str:
    """Why the factory ``path`` is not imported (one line): its module, what is allowed and where
    from (``configured``: the setting is set, else its default)."""
    allowed = ", ".join(patterns) or "no module"
    where = (f"it allows: {allowed}" if configured else
             f"unset, it allows the modules of ASYNCINFER_MODEL_FACTORIES: {allowed}")
    return (f"factory {path}: module '{module_of(path)}' is not allowed by {SETTING} on this "
            f"worker ({where}); importing a module runs its code and any producer on the broker "
            f"can send this command, so a worker imports only the modules its operator lists there")
