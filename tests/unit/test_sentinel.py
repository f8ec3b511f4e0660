"""Redis Sentinel with no server: Celery's ``sentinel://`` URLs for broker and results, the
settings, Celery's configuration, and the client's Sentinel pool. Failover and
``ASYNCINFER_SUBMIT_REPLICAS`` against a Sentinel group: tests/faults/test_sentinel.py.
"""

from __future__ import annotations

import pytest
import redis

from asyncinfer.broker.connections import redis_client, wait_replicas
from asyncinfer.broker.urls import SentinelUrl, is_redis_url, normalized_url, parse_sentinel_url
from asyncinfer.config.celery_config import celery_config
from asyncinfer.config.settings import Settings
from asyncinfer.worker.step import uses_fast_consumer

# -- URL parsing, settings and Celery's configuration (no server) ---------------------------------


def test_a_sentinel_url_names_every_sentinel_and_the_masters_database_and_password() -> None:
    parsed = parse_sentinel_url("sentinel://:s%40cret@10.0.0.1:26379;sentinel://10.0.0.2;"
                                "sentinel://h3:26380/2")
    assert parsed == SentinelUrl((("10.0.0.1", 26379), ("10.0.0.2", 26379), ("h3", 26380)),
                                 db=2, password="s@cret")
    assert parse_sentinel_url("sentinel://u:p@h:1/0").username == "u"
    assert parse_sentinel_url("sentinel://h:1").db == 0


@pytest.mark.parametrize("url, rule", [
    ("sentinel://a:1/1;sentinel://b:2/2", "different databases"),
    ("sentinel://:x@a:1;sentinel://:y@b:2", "different passwords"),
    ("sentinel://a:1;redis://b:2", "must start with sentinel://"),
    ("sentinel://a:port", "the port must be a number"),
    ("sentinel://a:1/zero", "the database must be a number"),
    ("sentinel://:pw@", "names no host"),
    (";", "at least one Sentinel"),
])
def test_a_malformed_sentinel_url_is_refused_naming_the_rule(url: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        parse_sentinel_url(url)


def test_the_database_and_password_of_any_entry_reach_every_entry() -> None:
    # Celery and kombu read them from the first entry only: the contract form puts the db last.
    assert (normalized_url("sentinel://:pw@a:1;sentinel://b:2/3")
            == "sentinel://:pw@a:1/3;sentinel://:pw@b:2/3")
    assert normalized_url("redis://h:1/4") == "redis://h:1/4"


def test_redis_urls_are_recognised_by_scheme() -> None:
    for url in ("redis://h", "rediss://h", "unix:///tmp/r.sock", "sentinel://h:1;sentinel://g:2",
                "SENTINEL://h"):
        assert is_redis_url(url), url
    for url in ("amqp://h", "memory://", "", "h:6379"):
        assert not is_redis_url(url), url
    settings = Settings(broker_url="sentinel://h:1")
    assert uses_fast_consumer(settings, "sentinel://h:1")
    assert settings.resolved_result_backend() == "sentinel://h:1"


def test_celery_gets_the_master_name_and_sentinel_password_for_broker_and_backend() -> None:
    settings = Settings(broker_url="sentinel://a:1;sentinel://b:2/3", sentinel_master="cache",
                        sentinel_password="sp")
    conf = celery_config(settings)
    assert conf["broker_url"] == conf["result_backend"] == "sentinel://a:1/3;sentinel://b:2/3"
    for key in ("broker_transport_options", "result_backend_transport_options"):
        assert conf[key]["master_name"] == "cache"
        assert conf[key]["sentinel_kwargs"] == {"password": "sp"}
        assert conf[key]["visibility_timeout"] == settings.visibility_timeout_s
    plain = celery_config(Settings(broker_url="redis://h:1/0"))
    assert "master_name" not in plain["broker_transport_options"]


def test_sentinel_settings_come_from_the_environment_and_are_checked() -> None:
    settings = Settings.from_env({"ASYNCINFER_SENTINEL_MASTER": "m2",
                                  "ASYNCINFER_SENTINEL_PASSWORD": "pw",
                                  "ASYNCINFER_SUBMIT_REPLICAS": "2",
                                  "ASYNCINFER_SUBMIT_REPLICAS_TIMEOUT_S": "0.5"})
    assert (settings.sentinel_master, settings.sentinel_password) == ("m2", "pw")
    assert (settings.submit_replicas, settings.submit_replicas_timeout_s) == (2, 0.5)
    assert Settings().submit_replicas == 0 and Settings().sentinel_master == "mymaster"
    with pytest.raises(ValueError, match="submit_replicas must be an integer >= 0"):
        Settings(submit_replicas=-1)
    with pytest.raises(ValueError, match="WAIT 0 would wait forever"):
        Settings(submit_replicas=1, submit_replicas_timeout_s=0)


def test_a_sentinel_client_asks_for_the_named_master_with_its_credentials() -> None:
    settings = Settings(sentinel_master="cache", sentinel_password="sp", connect_timeout_s=2.0)
    client = redis_client("sentinel://:mp@a:1;sentinel://b:2/5", settings, health_check_interval=30)
    try:
        pool = client.connection_pool
        assert pool.service_name == "cache"
        assert pool.connection_kwargs["db"] == 5
        assert pool.connection_kwargs["password"] == "mp"
        assert pool.connection_kwargs["health_check_interval"] == 30
        sentinels = pool.sentinel_manager.sentinels
        assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
        assert all(s.connection_pool.connection_kwargs["password"] == "sp" for s in sentinels)
        assert all(s.connection_pool.connection_kwargs["socket_timeout"] == 2.0 for s in sentinels)
    finally:
        client.close()
    plain = redis_client("redis://127.0.0.1:1/2", settings)
    assert plain.connection_pool.connection_kwargs["db"] == 2
    plain.close()


def test_wait_replicas_refuses_a_wait_that_would_never_end() -> None:
    with pytest.raises(ValueError, match="would wait forever"):
        wait_replicas(redis.Redis(), 1, 0)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        wait_replicas(redis.Redis(), 0, 100)


