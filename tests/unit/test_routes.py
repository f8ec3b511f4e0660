"""The routing table (ASYNCINFER_BROKER_ROUTES): parsing, matching, validation, and the settings of
one route. With real brokers: tests/integration/test_routes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncinfer.client.brokers import RoutedGroups
from asyncinfer.config.routes import Route, Routes, parse_routes
from asyncinfer.config.settings import Settings

pytestmark = pytest.mark.timeout(30)

A, B, DEFAULT = "redis://a:6379/0", "redis://b:6379/1", "redis://d:6379/0"
SENTINEL = "sentinel://s1:26379;sentinel://s2:26379/2"


def test_inline_entries_in_order_with_globs_and_the_default_for_the_rest() -> None:
    routes = Routes.parse(f"resnet50={A}; bert-*={B};bert-large={A}", DEFAULT)
    assert routes.entries == (Route("resnet50", A), Route("bert-*", B), Route("bert-large", A))
    assert routes.url_for("resnet50") == A
    assert routes.url_for("bert-base") == B
    assert routes.url_for("bert-large") == B  # the first match wins
    assert routes.url_for("mlp") == DEFAULT
    assert routes.url_for("resnet5") == DEFAULT  # a name matches whole
    assert routes.urls() == [DEFAULT, A, B]


def test_a_sentinel_url_keeps_its_own_semicolons() -> None:
    routes = Routes.parse(f"bert-*={SENTINEL};mlp={A}", DEFAULT)
    assert routes.entries == (Route("bert-*", SENTINEL), Route("mlp", A))
    assert routes.url_for("bert-x") == SENTINEL


def test_a_url_with_a_query_keeps_its_equals_signs() -> None:
    url = "rediss://a:6380/0?ssl_cert_reqs=none"
    assert parse_routes(f"mlp={url}") == [Route("mlp", url)]


def test_a_json_file_by_at_or_by_its_suffix(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"resnet50": A, "bert-*": B, "*": SENTINEL}))
    expected = [Route("resnet50", A), Route("bert-*", B), Route("*", SENTINEL)]
    assert parse_routes(f"@{path}") == expected
    assert parse_routes(str(path)) == expected
    assert Routes.parse(f"@{path}", DEFAULT).url_for("anything") == SENTINEL


def test_empty_means_one_broker() -> None:
    routes = Routes.parse("  ", DEFAULT)
    assert not routes
    assert routes.url_for("mlp") == DEFAULT
    assert routes.urls() == [DEFAULT]
    assert Settings(broker_url=DEFAULT).for_models(["mlp", "bert"]) == Settings(broker_url=DEFAULT)


@pytest.mark.parametrize(("text", "says"), [
    ("resnet50", "entry 1 ('resnet50') has no '='"),
    (f"mlp={A};{B}", "entry 2"),
    (f"bert base={A}", "entry 'bert base': the pattern must be a model name or a glob"),
    (f"={A}", "entry '': the pattern must be"),
    ("mlp=localhost:6379", "entry 'mlp': 'localhost:6379' is not a broker URL"),
    ("mlp=redis://:secret@a:6379/0;x=nope", "entry 'x': 'nope' is not a broker URL"),
    ("mlp=sentinel://s1:26379;redis://a:6379/0", "every ';' part of a Sentinel URL"),
])
def test_a_malformed_entry_is_named_with_the_rule(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="ASYNCINFER_BROKER_ROUTES") as caught:
        Settings(broker_routes=text)
    assert says in str(caught.value)
    assert "secret" not in str(caught.value)


def test_a_url_that_is_not_one_hides_its_password() -> None:
    with pytest.raises(ValueError) as caught:
        Settings(broker_routes="mlp=a:secret@host")
    assert "secret" not in str(caught.value)
    assert "…@host" in str(caught.value)


def test_bad_files_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    with pytest.raises(ValueError, match=f"cannot read {missing}"):
        Settings(broker_routes=f"@{missing}")
    (tmp_path / "list.json").write_text(json.dumps([["mlp", A]]))
    with pytest.raises(ValueError, match="must hold one JSON object"):
        Settings(broker_routes=str(tmp_path / "list.json"))
    (tmp_path / "bad.json").write_text("{mlp: ")
    with pytest.raises(ValueError, match="is not JSON"):
        Settings(broker_routes=str(tmp_path / "bad.json"))
    (tmp_path / "url.json").write_text(json.dumps({"mlp": 6379}))
    with pytest.raises(ValueError, match=r"entry 'mlp' of .*url.json: 6379 is not a broker URL"):
        Settings(broker_routes=str(tmp_path / "url.json"))


def test_a_broker_that_is_not_redis_needs_one_result_backend() -> None:
    with pytest.raises(ValueError, match="entry 'mlp': its broker is not Redis, so "
                                         "ASYNCINFER_RESULT_BACKEND must"):
        Settings(broker_url=DEFAULT, broker_routes="mlp=amqp://guest@rabbit//")
    settings = Settings(broker_url=DEFAULT, result_backend=B,
                        broker_routes="mlp=amqp://guest@rabbit//")
    assert settings.for_models(["mlp"]).resolved_broker_url() == "amqp://guest@rabbit//"
    assert settings.for_models(["mlp"]).resolved_result_backend() == B


def test_from_env_reads_the_table() -> None:
    settings = Settings.from_env({"ASYNCINFER_BROKER_URL": DEFAULT,
                                  "ASYNCINFER_BROKER_ROUTES": f"bert-*={B}"})
    assert settings.routes().url_for("bert-base") == B
    assert settings.routes().default_url == DEFAULT


def test_one_route_s_settings_put_results_on_its_own_broker_unless_one_backend_is_named() -> None:
    settings = Settings(broker_url=DEFAULT, broker_routes=f"bert-*={B}")
    bert = settings.for_models(["bert-base", "bert-large"])
    assert (bert.resolved_broker_url(), bert.resolved_result_backend()) == (B, B)
    assert bert.broker_routes == ""
    mlp = settings.for_models(["mlp"])
    assert (mlp.resolved_broker_url(), mlp.resolved_result_backend()) == (DEFAULT, DEFAULT)
    shared = Settings(broker_url=DEFAULT, result_backend=A, broker_routes=f"bert-*={B}")
    assert shared.for_models(["bert-base"]).resolved_result_backend() == A


def test_the_default_route_keeps_where_the_broker_url_came_from(tmp_path: Path) -> None:
    settings = Settings(state_dir=str(tmp_path), broker_routes=f"bert-*={B}")
    assert settings.for_broker(settings.resolved_broker_url()).broker_url_origin() == "default"


def test_a_worker_s_models_on_two_brokers_are_named_with_their_urls() -> None:
    settings = Settings(broker_url=DEFAULT, broker_routes="bert-*=redis://:pw@b:6379/1")
    with pytest.raises(ValueError) as caught:
        settings.for_models(["bert-base", "mlp", "bert-large"])
    text = str(caught.value)
    assert "bert-base, bert-large on redis://:**@b:6379/1" in text
    assert f"mlp on {DEFAULT}" in text
    assert "one worker per broker" in text


# -- the client's groups: a catalogue per broker, merged ---------------------------------------

class _Group:
    """A broker's group whose catalogue read answers ``entries`` or raises ``down``."""

    def __init__(self, *names: str) -> None:
        from asyncinfer.broker.catalogue import CatalogueEntry

        self.entries = {n: CatalogueEntry(n) for n in names}
        self.down: Exception | None = None

    def models(self) -> dict[str, object]:
        if self.down is not None:
            raise self.down
        return dict(self.entries)


def _groups() -> tuple[RoutedGroups, _Group, _Group]:
    a, b = _Group("identity", "mlp"), _Group("mlp", "bert-base")  # mlp also on b, by hand
    routes = Routes.parse(f"bert-*={B};mlp={B}", DEFAULT)
    groups = RoutedGroups(routes, Settings(broker_url=DEFAULT), a)  # type: ignore[arg-type]
    groups._groups[B] = b  # type: ignore[assignment]
    return groups, a, b


def test_the_merged_catalogue_takes_each_model_from_its_own_broker() -> None:
    groups, a, b = _groups()
    merged = groups.models()
    assert list(merged) == ["identity", "mlp", "bert-base"]
    assert merged["mlp"] is b.entries["mlp"]


def test_a_broker_down_keeps_its_last_catalogue_only_when_stale_is_ok() -> None:
    from asyncinfer.errors import BrokerUnavailable

    groups, a, b = _groups()
    groups.models()
    b.down = BrokerUnavailable("connection refused")
    with pytest.raises(BrokerUnavailable, match=f"{B}: connection refused"):
        groups.models()
    assert set(groups.models(stale_ok=True)) == {"identity", "mlp", "bert-base"}
    a.down = BrokerUnavailable("also down")
    with pytest.raises(BrokerUnavailable):  # none answers: said, not an empty catalogue
        groups.models(stale_ok=True)
