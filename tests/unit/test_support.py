"""The tests' own support: helpers come from tests/support/ (never from conftest), and the
database allocator hands out each database of the session Redis to one holder at a time."""

from __future__ import annotations

import re
from pathlib import Path

import fakeredis
import pytest

from tests.support.databases import RedisDatabases, db_of, url_with_db
from tests.support.waiting import wait_for

TESTS = Path(__file__).resolve().parents[1]
#: An import of the conftest module, in any of its spellings.
CONFTEST_IMPORT = re.compile(r"^\s*(from\s+(tests\.)?conftest\s+import\b|import\s+(tests\.)?conftest\b)",
                             re.MULTILINE)


def _conftest_imports(text: str) -> list[str]:
    return [m.group(0).strip() for m in CONFTEST_IMPORT.finditer(text)]


def test_the_pattern_finds_every_spelling_of_a_conftest_import() -> None:
    text = ("from tests.conftest import ROOT\n    from conftest import wait_for\n"
            "import tests.conftest\nimport conftest as c\n"
            "from tests.support.processes import ROOT  # not conftest\nx = 'from conftest import y'\n")
    assert _conftest_imports(text) == ["from tests.conftest import", "from conftest import",
                                       "import tests.conftest", "import conftest"]


def test_no_test_module_imports_from_conftest() -> None:
    # Given every Python file under tests/ (the support package too)
    files = sorted(p for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert len(files) > 30 and TESTS / "support" / "processes.py" in files
    # Then none imports conftest: helpers live in tests/support/, fixtures come from pytest
    found = {str(p.relative_to(TESTS)): imports for p in files
             if (imports := _conftest_imports(p.read_text(encoding="utf-8")))}
    assert found == {}


def _fake_connect(server: fakeredis.FakeServer):  # type: ignore[no-untyped-def]
    return lambda url: fakeredis.FakeRedis(server=server, db=db_of(url))


def test_databases_are_handed_out_once_emptied_and_never_the_session_workers() -> None:
    server = fakeredis.FakeServer()
    connect = _fake_connect(server)
    session = "redis://127.0.0.1:6399/2"
    connect(url_with_db(session, 0)).set("left-over", 1)
    dbs = RedisDatabases(session, count=4, connect=connect)
    # When two holders take a database each
    with dbs.take("first") as first, dbs.take("second") as second:
        # Then each got its own number, not the session's, empty, with a URL and client of it
        assert (first.number, second.number) == (0, 1)
        assert first.url == "redis://127.0.0.1:6399/0" and second.url == "redis://127.0.0.1:6399/1"
        assert first.client.dbsize() == 0
        first.client.set("mine", "a")
        assert second.client.get("mine") is None
        assert dbs.held == {0: "first", 1: "second"}
    # And given back, both are empty and free again
    assert dbs.held == {}
    assert connect(url_with_db(session, 0)).dbsize() == 0


def test_a_given_back_database_goes_to_the_back_of_the_line() -> None:
    dbs = RedisDatabases("redis://h:1/0", count=4, connect=_fake_connect(fakeredis.FakeServer()))
    numbers = []
    for _ in range(4):
        with dbs.take() as db:
            numbers.append(db.number)
    assert numbers == [1, 2, 3, 1]


def test_taking_more_databases_than_there_are_names_the_holders() -> None:
    dbs = RedisDatabases("redis://h:1", count=2, connect=_fake_connect(fakeredis.FakeServer()))
    with dbs.take("the only one"):
        with pytest.raises(RuntimeError, match=r"every database of redis://h:1 is held: "
                                               r"\{1: 'the only one'\}"):
            with dbs.take("one too many"):
                pass
    with dbs.take() as db:  # still usable afterwards
        assert db.number == 1


def test_a_database_is_given_back_when_its_holder_fails() -> None:
    server = fakeredis.FakeServer()
    dbs = RedisDatabases("redis://h:1/0", count=2, connect=_fake_connect(server))
    with pytest.raises(ValueError, match="boom"), dbs.take() as db:
        db.client.set("k", "v")
        raise ValueError("boom")
    assert dbs.held == {} and fakeredis.FakeRedis(server=server, db=1).dbsize() == 0


def test_wait_for_returns_the_value_or_names_what_never_came() -> None:
    answers = iter([None, 0, [], "here"])
    assert wait_for(lambda: next(answers), 5, "an answer", poll_s=0.001) == "here"
    with pytest.raises(TimeoutError, match=r"the impossible not seen in 0.01 s"):
        wait_for(lambda: False, 0.01, "the impossible", poll_s=0.001)
