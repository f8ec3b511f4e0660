"""docs/architecture.md says the tree as it is: every module of the package is named there by its
path relative to asyncinfer/ (in backticks: `broker/take.py`), and every ``.py`` path it names in
backticks exists.

- Exempt from being named: each folder's ``__init__.py`` (the page names those that hold code of
  their own, and those it names must exist) and the generated protobuf modules
  (``gateway/proto/*_pb2*.py``, ``models/proto/*_pb2*.py``, made by ``make proto``).
- A named path under ``tests/``, ``bench/``, ``examples/``, ``deploy/`` or ``asyncinfer/`` is looked
  for from the repository's root; every other one from ``asyncinfer/``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncinfer"
PAGE = ROOT / "docs" / "architecture.md"
#: Paths that begin with one of these are the repository's, not the package's.
FROM_ROOT = ("tests/", "bench/", "examples/", "deploy/", "asyncinfer/")
#: A backticked span that is a path to a Python file, and nothing else.
_NAMED = re.compile(r"`([\w./-]+\.py)`")


def exempt(relative: str) -> bool:
    """Whether a module need not be named: a folder's ``__init__.py``, a generated protobuf module."""
    name = relative.rsplit("/", 1)[-1]
    return name == "__init__.py" or (relative.startswith(("gateway/proto/", "models/proto/"))
                                     and "_pb2" in name)


def modules(package: Path = PACKAGE) -> list[str]:
    """Every module under ``package`` by its path relative to it, the exempt ones left out."""
    return sorted(rel for path in package.rglob("*.py")
                  if "__pycache__" not in path.parts
                  and not exempt(rel := path.relative_to(package).as_posix()))


def named(text: str) -> set[str]:
    """The ``.py`` paths ``text`` names in backticks."""
    return set(_NAMED.findall(text))


def unnamed(text: str, wanted: list[str]) -> list[str]:
    """The modules of ``wanted`` that ``text`` does not name."""
    names = named(text)
    return [module for module in wanted if module not in names]


def stale(text: str, root: Path = ROOT, package: Path = PACKAGE) -> list[str]:
    """The ``.py`` paths ``text`` names that do not exist (see the module's rules)."""
    return sorted(path for path in named(text)
                  if not ((root if path.startswith(FROM_ROOT) else package) / path).is_file())


# -- the check itself ---------------------------------------------------------------------------

def test_the_check_reports_a_module_the_text_does_not_name() -> None:
    text = "- `broker/take.py`: the take.\n- `worker/pipeline.py`: its life, and `take.py` alone.\n"
    wanted = ["broker/take.py", "worker/consumers/fast_consumer.py", "worker/pipeline.py"]
    assert unnamed(text, wanted) == ["worker/consumers/fast_consumer.py"]
    # a path named outside backticks, or only by its file name, does not count
    assert unnamed("worker/consumers/fast_consumer.py, `fast_consumer.py`", wanted[1:2]) == wanted[1:2]


def test_the_check_reports_a_path_that_is_gone(tmp_path: Path) -> None:
    package = tmp_path / "asyncinfer"
    (package / "broker").mkdir(parents=True)
    (package / "broker" / "take.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    text = ("`broker/take.py` `intake/take.py` `tests/test_x.py` `tests/test_gone.py` "
            "`asyncinfer/broker/take.py` `asyncinfer/take.py` `celery -A asyncinfer worker`")
    assert stale(text, tmp_path, package) == ["asyncinfer/take.py", "intake/take.py",
                                              "tests/test_gone.py"]


def test_exempt_modules() -> None:
    assert exempt("__init__.py") and exempt("worker/output/__init__.py")
    assert exempt("gateway/proto/inference_pb2.py") and exempt("models/proto/model_config_pb2.py")
    assert not exempt("gateway/grpc_api.py") and not exempt("__main__.py")


def test_the_package_is_read() -> None:
    found = modules()
    assert {"broker/take.py", "worker/consumers/consumer.py", "errors.py", "__main__.py"} <= set(found)
    assert not [m for m in found if m.endswith("__init__.py") or "_pb2" in m]


# -- the page -----------------------------------------------------------------------------------

def test_the_page_names_every_module() -> None:
    missing = unnamed(PAGE.read_text(), modules())
    assert missing == [], f"docs/architecture.md does not name these modules: {missing}"


def test_every_path_the_page_names_exists() -> None:
    gone = stale(PAGE.read_text())
    assert gone == [], f"docs/architecture.md names paths that do not exist: {gone}"
