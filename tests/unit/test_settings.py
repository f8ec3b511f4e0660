"""Settings from the environment, their validation, broker resolution and the Celery config.

A URL published by a server that has exited: tests/integration/test_settings.py (it starts one)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from asyncinfer.config.celery_config import celery_config
from asyncinfer.config.published import PID_FILE, URL_FILE
from asyncinfer.config.settings import DEFAULT_BROKER_URL, Settings
from asyncinfer.config.settings_report import settings_table

pytestmark = pytest.mark.timeout(30)


def publish_dir(state_dir: Path) -> Path:
    """The folder inside ``state_dir`` where ``asyncinfer up``'s Redis publishes its URL."""
    settings = Settings(state_dir=str(state_dir))
    return Path(getattr(settings, "redis_dir", settings.state_path))


def publish(state_dir: Path, url: str, pid: int) -> None:
    """Write what a running ``asyncinfer up`` publishes: the broker URL and its Redis PID."""
    state_dir = publish_dir(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / URL_FILE).write_text(url + "\n")
    (state_dir / PID_FILE).write_text(f"{pid}\n")


# -- from_env ----------------------------------------------------------------------------------


def default(name: str) -> object:
    return next(f.default for f in dataclasses.fields(Settings) if f.name == name)


def test_defaults_with_an_empty_environ() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    for f in dataclasses.fields(Settings):
        assert getattr(s, f.name) == f.default, f.name
    assert s.models == () and s.task_serializer == "json" and s.device == "auto"


def test_from_env_parses_ints_floats_and_comma_tuples() -> None:
    env = {
        "ASYNCINFER_CONCURRENCY": "3",
        "ASYNCINFER_PREFETCH_MULTIPLIER": "5",
        "ASYNCINFER_RESULT_EXPIRES_S": "0.5",
        "ASYNCINFER_VISIBILITY_TIMEOUT_S": "120",
        "ASYNCINFER_MODELS": " mlp, identity,,sleep ,",
        "ASYNCINFER_MODEL_FACTORIES": "a=pkg.mod:f",
        "ASYNCINFER_DEVICE": "cuda:1",
        "ASYNCINFER_TASK_SERIALIZER": "msgpack",
        "ASYNCINFER_UNRELATED": "ignored",
    }
    s = Settings.from_env(env)
    assert s.concurrency == 3 and isinstance(s.concurrency, int)
    assert s.prefetch_multiplier == 5
    assert s.result_expires_s == 0.5 and isinstance(s.result_expires_s, float)
    assert s.visibility_timeout_s == 120.0 and isinstance(s.visibility_timeout_s, float)
    assert s.models == ("mlp", "identity", "sleep")
    assert s.model_factories == ("a=pkg.mod:f",)
    assert s.device == "cuda:1"
    assert s.task_serializer == "msgpack"
    # untouched fields keep their defaults
    assert s.redis_port == default("redis_port") and s.result_serializer == "json"


def test_empty_variables_are_treated_as_unset() -> None:
    s = Settings.from_env({"ASYNCINFER_CONCURRENCY": "", "ASYNCINFER_MODELS": ""})
    assert s.concurrency == default("concurrency") and s.models == ()


def test_overrides_win_over_env_and_none_overrides_are_ignored() -> None:
    env = {"ASYNCINFER_CONCURRENCY": "3", "ASYNCINFER_DEVICE": "cpu", "ASYNCINFER_PREFETCH_MULTIPLIER": "7"}
    s = Settings.from_env(env, concurrency=9, device=None, prefetch_multiplier=None, models=("mlp",))
    assert s.concurrency == 9  # override wins
    assert s.device == "cpu"  # None override: the environment's value stays
    assert s.prefetch_multiplier == 7
    assert s.models == ("mlp",)


@pytest.mark.parametrize(("var", "raw"), [
    ("ASYNCINFER_CONCURRENCY", "abc"),
    ("ASYNCINFER_PREFETCH_MULTIPLIER", "1.5"),
    ("ASYNCINFER_VISIBILITY_TIMEOUT_S", "soon"),
    ("ASYNCINFER_REDIS_PORT", "x"),
])
def test_unparsable_values_name_the_variable(var: str, raw: str) -> None:
    with pytest.raises(ValueError, match=var) as info:
        Settings.from_env({var: raw})
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize(("env", "overrides", "field"), [
    ({}, {"concurrency": 0}, "concurrency"),
    ({"ASYNCINFER_CONCURRENCY": "0"}, {}, "concurrency"),
    ({"ASYNCINFER_PREFETCH_MULTIPLIER": "-1"}, {}, "prefetch_multiplier"),
    ({}, {"consumer": "eager"}, "consumer"),
    ({"ASYNCINFER_MODEL_OPTIONS": "{not json"}, {}, "ASYNCINFER_MODEL_OPTIONS"),
    ({}, {"visibility_timeout_s": -0.5}, "visibility_timeout_s"),
    ({}, {"result_expires_s": -1.0}, "result_expires_s"),
    ({}, {"task_serializer": "pickle"}, "task_serializer"),
    ({"ASYNCINFER_RESULT_SERIALIZER": "pickle"}, {}, "result_serializer"),
    ({"ASYNCINFER_LEASE_S": "0.5"}, {}, "lease_s"),
    ({}, {"lease_s": -1.0}, "lease_s"),
    ({"ASYNCINFER_MAX_WORKER_DEATHS": "-1"}, {}, "max_worker_deaths"),
    ({}, {"hold_batches": -2}, "hold_batches"),
    ({"ASYNCINFER_MODEL_CONTROL_MODE": "poll"}, {}, "ASYNCINFER_MODEL_CONTROL_MODE"),
    ({}, {"model_control_mode": "EXPLICIT"}, "--model-control-mode"),
])
def test_invalid_values_name_the_field(env: dict[str, str], overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Settings.from_env(env, **overrides)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_non_finite_or_negative_durations_are_rejected(value: str) -> None:
    with pytest.raises(ValueError, match="visibility_timeout_s"):
        Settings.from_env({"ASYNCINFER_VISIBILITY_TIMEOUT_S": value})


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_delay_is_rejected(delay: float) -> None:
    from asyncinfer.config.model_options import ModelOptions

    with pytest.raises(ValueError, match="max_delay_ms"):
        ModelOptions(max_delay_ms=delay)


def test_model_options_merge_defaults_star_and_model_entries() -> None:
    from asyncinfer.config.model_options import ModelOptions

    s = Settings.from_env({"ASYNCINFER_MODEL_OPTIONS":
                           '{"*": {"max_delay_ms": 5}, "mlp": {"max_batch_size": 64, '
                           '"preferred_batch_sizes": [32, 8], "instances": 2}}'})
    defaults = ModelOptions(max_batch_size=16, max_delay_ms=1.0)
    mlp = s.options_for("mlp", defaults)
    assert (mlp.max_batch_size, mlp.max_delay_ms, mlp.preferred_batch_sizes, mlp.instances) == (
        64, 5, (8, 32), 2)
    other = s.options_for("identity", defaults)
    assert (other.max_batch_size, other.max_delay_ms, other.instances) == (16, 5, 1)
    with pytest.raises(ValueError, match="unknown model option"):
        Settings.from_env({"ASYNCINFER_MODEL_OPTIONS": '{"mlp": {"batch": 3}}'}).options_for("mlp", defaults)
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        s.options_for("mlp", defaults).merged({"preferred_batch_sizes": [128]})


# -- broker and result backend -----------------------------------------------------------------


def test_result_backend_falls_back_to_a_redis_broker(tmp_path: Path) -> None:
    s = Settings.from_env({}, broker_url="redis://h:1/2", state_dir=str(tmp_path))
    assert s.resolved_result_backend() == "redis://h:1/2"
    s = Settings.from_env({}, broker_url="rediss://h:1/2", state_dir=str(tmp_path))
    assert s.resolved_result_backend() == "rediss://h:1/2"


def test_explicit_result_backend_wins() -> None:
    s = Settings.from_env({"ASYNCINFER_BROKER_URL": "amqp://guest@h//",
                           "ASYNCINFER_RESULT_BACKEND": "redis://r:6379/1"})
    assert s.resolved_result_backend() == "redis://r:6379/1"


def test_amqp_broker_without_a_backend_raises() -> None:
    s = Settings.from_env({"ASYNCINFER_BROKER_URL": "amqp://guest@h//"})
    with pytest.raises(ValueError, match="ASYNCINFER_RESULT_BACKEND") as info:
        s.resolved_result_backend()
    assert "amqp://guest@h//" in str(info.value)


def test_explicit_broker_url_wins_over_a_published_one(tmp_path: Path) -> None:
    publish(tmp_path, "redis://127.0.0.1:7777/0", os.getpid())
    s = Settings.from_env({"ASYNCINFER_BROKER_URL": "redis://explicit:1/0",
                           "ASYNCINFER_STATE_DIR": str(tmp_path)})
    assert s.resolved_broker_url() == "redis://explicit:1/0"


def test_broker_url_published_by_a_live_server_is_used(tmp_path: Path) -> None:
    # Given: a state dir where a server whose PID is alive (this process) published its URL
    publish(tmp_path, "redis://127.0.0.1:7777/0", os.getpid())
    # When: no broker URL is configured
    s = Settings.from_env({"ASYNCINFER_STATE_DIR": str(tmp_path)})
    # Then: the published URL is the broker and the result backend
    assert s.resolved_broker_url() == "redis://127.0.0.1:7777/0"
    assert s.resolved_result_backend() == "redis://127.0.0.1:7777/0"
    assert celery_config(s)["broker_url"] == "redis://127.0.0.1:7777/0"


def test_default_broker_without_a_published_url(tmp_path: Path) -> None:
    s = Settings.from_env({"ASYNCINFER_STATE_DIR": str(tmp_path / "empty")})
    assert s.resolved_broker_url() == DEFAULT_BROKER_URL
    # a half-written state dir (URL but no PID file, or a garbage PID) is ignored too
    folder = publish_dir(tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / URL_FILE).write_text("redis://127.0.0.1:7777/0")
    s = Settings.from_env({"ASYNCINFER_STATE_DIR": str(tmp_path)})
    assert s.resolved_broker_url() == DEFAULT_BROKER_URL
    (folder / PID_FILE).write_text("not-a-pid")
    assert s.resolved_broker_url() == DEFAULT_BROKER_URL


def test_state_path_uses_the_state_dir(tmp_path: Path) -> None:
    assert Settings(state_dir=str(tmp_path)).state_path == tmp_path


# -- settings_table ----------------------------------------------------------------------------


def test_settings_table_has_one_row_per_field_with_every_variable() -> None:
    table = settings_table()
    lines = table.splitlines()
    fields = dataclasses.fields(Settings)
    assert lines[0].startswith("| Variable |")
    assert len(lines) == 2 + len(fields)
    for f in fields:
        env = f.metadata["env"]
        assert env.startswith("ASYNCINFER_")
        assert sum(f"`{env}`" in line for line in lines) == 1, env
    for f in fields:
        row = next(line for line in lines if f"`{f.metadata['env']}`" in line)
        assert f.metadata["doc"] in row
        if f.default not in ("", ()):
            shown = ",".join(f.default) if isinstance(f.default, tuple) else f.default
            shown = str(shown).lower() if isinstance(shown, bool) else shown
            assert f"`{shown}`" in row, row
    assert f"| `ASYNCINFER_CONCURRENCY` | `{default('concurrency')}` |" in table


# -- celery_config -----------------------------------------------------------------------------


def test_celery_config_is_safe_and_follows_settings() -> None:
    env = {"ASYNCINFER_BROKER_URL": "redis://b:1/0", "ASYNCINFER_VISIBILITY_TIMEOUT_S": "123.5",
           "ASYNCINFER_RESULT_EXPIRES_S": "60", "ASYNCINFER_CONCURRENCY": "5",
           "ASYNCINFER_PREFETCH_MULTIPLIER": "2", "ASYNCINFER_TASK_SERIALIZER": "msgpack"}
    conf = celery_config(Settings.from_env(env))
    assert "pickle" not in conf["accept_content"]
    assert "pickle" not in conf["result_accept_content"]
    assert set(conf["accept_content"]) == {"json", "msgpack"}
    assert conf["task_serializer"] == "msgpack" and conf["result_serializer"] == "json"
    assert conf["task_acks_late"] is True
    assert conf["task_reject_on_worker_lost"] is True
    assert conf["task_track_started"] is True
    assert conf["broker_transport_options"]["visibility_timeout"] == 123.5
    assert conf["result_backend_transport_options"]["visibility_timeout"] == 123.5
    assert conf["result_expires"] == 60.0
    assert conf["worker_pool"] == "threads"
    assert conf["worker_concurrency"] == 5 and conf["worker_prefetch_multiplier"] == 2
    assert conf["broker_url"] == "redis://b:1/0" and conf["result_backend"] == "redis://b:1/0"


def test_celery_config_lists_are_copies() -> None:
    # mutating one config must not leak pickle into the next
    s = Settings.from_env({"ASYNCINFER_BROKER_URL": "redis://b:1/0"})
    first = celery_config(s)
    first["accept_content"].append("pickle")
    assert "pickle" not in celery_config(s)["accept_content"]


def test_the_cost_ratio_follows_the_device_unless_set() -> None:
    from asyncinfer.config.model_options import ModelOptions

    default = ModelOptions()
    assert default.max_cost_ratio is None
    assert (default.cost_ratio(accelerator=False), default.cost_ratio(accelerator=True)) == (1.25, 2.0)
    mine = Settings.from_env({"ASYNCINFER_MODEL_OPTIONS": '{"minilm": {"max_cost_ratio": 3}}'}
                             ).options_for("minilm", default)
    assert (mine.cost_ratio(accelerator=False), mine.cost_ratio(accelerator=True)) == (3.0, 3.0)
    for bad in (0.5, "2", True, float("nan")):
        with pytest.raises(ValueError, match="max_cost_ratio must be a finite number >= 1"):
            ModelOptions(max_cost_ratio=bad)  # type: ignore[arg-type]
