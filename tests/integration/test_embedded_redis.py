"""The embedded Redis of ``asyncinfer up`` is private to its user: a password (kept in the state
folder, carried by the published URL), no CONFIG/DEBUG/MODULE, nothing group or world readable."""

from __future__ import annotations

import os
import signal
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

import asyncinfer.ops.redis_server as redis_server
from asyncinfer.client import Client
from asyncinfer.config.published import PID_FILE, URL_FILE, published_url
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import CONF_FILE, PASSWORD_FILE, RedisServer, make_private_dir
from asyncinfer.ops.status import cluster_status
from asyncinfer.ops.up import start_embedded_redis
from asyncinfer.supervision.processes import pid_alive
from tests.support.processes import embedded_up_env, start_up, stop_up
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


def mode(path: Path) -> int:
    """The permission bits of ``path``."""
    return stat.S_IMODE(os.stat(path).st_mode)


def settings_for(state: Path) -> Settings:
    """What a client or `up` of this user sees with only ``ASYNCINFER_STATE_DIR`` set."""
    return Settings.from_env(environ={"ASYNCINFER_STATE_DIR": str(state)})


def raw_reply(port: int, command: bytes) -> bytes:
    """The first reply line of the server to ``command`` sent on a fresh, unauthenticated socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(command + b"\r\n")
        return s.makefile("rb").readline()


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[RedisServer]:
    """The embedded Redis started the way `asyncinfer up` starts it, state folder ``tmp_path/state``."""
    server = start_embedded_redis(settings_for(tmp_path / "state"))
    try:
        yield server
    finally:
        server.stop()


def test_without_the_password_a_connection_is_refused(embedded: RedisServer) -> None:
    assert raw_reply(embedded.port, b"PING").startswith(b"-NOAUTH")
    assert raw_reply(embedded.port, b"AUTH wrong-password").startswith(b"-WRONGPASS")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=embedded.port).set("k", "v")
    # With the password it works
    assert embedded.password and len(embedded.password) >= 32
    with redis.Redis(port=embedded.port, password=embedded.password) as r:
        r.set("k", "v")
        assert r.get("k") == b"v"


@pytest.mark.parametrize("command", ["CONFIG SET dir /tmp", "CONFIG GET dir", "DEBUG SLEEP 0",
                                     "MODULE LIST"])
def test_dangerous_commands_are_unknown(embedded: RedisServer, command: str) -> None:
    with redis.Redis.from_url(embedded.url) as r:
        with pytest.raises(redis.ResponseError, match="unknown command"):
            r.execute_command(*command.split())
        assert r.ping()  # the connection was authenticated: the command itself is gone


def test_everything_it_keeps_is_private(embedded: RedisServer, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with redis.Redis.from_url(embedded.url) as r:
        r.set("k", "v")
        r.save()  # a dump too
    data = embedded.data_dir
    assert data == state / "redis"
    assert mode(state) == 0o700 and mode(data) == 0o700
    for name in (PASSWORD_FILE, URL_FILE, PID_FILE, CONF_FILE, "appendonly.aof", "dump.rdb",
                 "redis.log"):
        assert mode(data / name) == 0o600, name
    leaky = {str(p): oct(mode(p)) for p in data.rglob("*") if mode(p) & 0o077}
    assert leaky == {}
    assert (data / PASSWORD_FILE).read_text().strip() == embedded.password


def test_the_password_is_not_on_the_command_line(embedded: RedisServer) -> None:
    # (`ps` shows any user a command line; Redis retitles itself, but only once it has started)
    assert embedded.process is not None and embedded.password
    argv = [str(a) for a in embedded.process.args]  # type: ignore[union-attr]
    assert argv[1] == str(embedded.data_dir / CONF_FILE)  # the secrets went in its config file
    assert not [a for a in argv if embedded.password in a]
    assert f"requirepass \"{embedded.password}\"" in (embedded.data_dir / CONF_FILE).read_text()


def test_a_client_with_only_the_state_dir_finds_the_url_with_the_password(
        embedded: RedisServer, tmp_path: Path) -> None:
    url = settings_for(tmp_path / "state").resolved_broker_url()
    assert url == embedded.url == f"redis://:{embedded.password}@127.0.0.1:{embedded.port}/0"
    assert published_url(embedded.data_dir) == url
    with redis.Redis.from_url(url) as r:
        assert r.ping()


def test_a_restart_reuses_the_password_and_keeps_the_data(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "state")
    first = start_embedded_redis(settings)
    try:
        with redis.Redis.from_url(first.url) as r:
            r.set("kept", "yes")
    finally:
        first.stop()
    assert published_url(first.data_dir) is None
    second = start_embedded_redis(settings)
    try:
        assert second.password == first.password
        with redis.Redis.from_url(settings.resolved_broker_url()) as r:
            assert r.get("kept") == b"yes"
    finally:
        second.stop()


def test_what_an_older_server_left_open_is_closed(tmp_path: Path) -> None:
    # Given a state folder an unprotected server left readable to all, password file included
    state = tmp_path / "state"
    data = state / "redis"
    data.mkdir(parents=True)
    os.chmod(state, 0o755)
    os.chmod(data, 0o755)
    (data / "redis.log").write_text("old log\n")
    (data / PASSWORD_FILE).write_text("seen-by-everyone\n")
    for p in (data / "redis.log", data / PASSWORD_FILE):
        os.chmod(p, 0o644)
    server = start_embedded_redis(settings_for(state))
    try:
        # Then folders are 0700, the old log (which Redis appends to) 0600, the password replaced
        assert mode(state) == 0o700 and mode(data) == 0o700
        assert mode(data / "redis.log") == 0o600
        assert server.password != "seen-by-everyone" and mode(data / PASSWORD_FILE) == 0o600
        assert raw_reply(server.port, b"AUTH seen-by-everyone").startswith(b"-WRONGPASS")
    finally:
        server.stop()


def test_a_folder_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(PermissionError, match="not to this user"):
        make_private_dir(tmp_path)


def test_the_test_fixture_server_stays_open(tmp_path: Path) -> None:
    # RedisServer without `private` is what the test fixtures use: no password, CONFIG available
    with RedisServer(tmp_path / "open", appendonly=False) as server:
        assert server.password is None and not (server.data_dir / PASSWORD_FILE).exists()
        with redis.Redis.from_url(server.url) as r:
            assert r.config_get("appendonly") == {"appendonly": "no"}


@pytest.mark.timeout(240)
def test_up_serves_a_client_configured_with_only_the_state_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a real `asyncinfer up` with no broker configured
    log = open(tmp_path / "up.log", "wb")
    up = start_up(embedded_up_env(tmp_path), log, "--models", "identity", "--concurrency", "2")
    data = tmp_path / "redis"
    started: list[int] = []
    try:
        url = wait_for(lambda: published_url(data), 60, "published broker URL")
        assert url is not None
        started.append(int((data / PID_FILE).read_text()))
        password = (data / PASSWORD_FILE).read_text().strip()
        # Then its Redis asks for the generated password, and what it keeps is private
        assert url.startswith(f"redis://:{password}@127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert raw_reply(port, b"PING").startswith(b"-NOAUTH")
        with redis.Redis.from_url(url) as r, pytest.raises(redis.ResponseError, match="unknown command"):
            r.execute_command("CONFIG", "SET", "dir", str(tmp_path))
        assert mode(tmp_path) == 0o700 and mode(data) == 0o700
        assert {n: mode(data / n) for n in (PASSWORD_FILE, URL_FILE, "appendonly.aof")} == {
            PASSWORD_FILE: 0o600, URL_FILE: 0o600, "appendonly.aof": 0o600}
        # And its own output does not show the password
        wait_for(lambda: "embedded Redis at" in (tmp_path / "up.log").read_text(), 30, "up's banner")
        assert password not in (tmp_path / "up.log").read_text()

        # When a Client() is made with only ASYNCINFER_STATE_DIR in its environment
        for name in [k for k in os.environ if k.startswith("ASYNCINFER_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("ASYNCINFER_STATE_DIR", str(tmp_path))
        with Client() as client:
            assert client.app.conf.broker_url == url
            started += [w.pid for w in wait_for(lambda: cluster_status(client.app, 0.5).workers, 90,
                                                "a worker")]
            # Then a request round trips through `up`'s worker
            got = client.infer("identity", np.array([[7.0]], np.float32), timeout_s=90)
            assert got["input"].tolist() == [[7.0]]

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not any(pid_alive(p) for p in started)
    finally:
        stop_up(up, started)
        log.close()
    assert password not in (tmp_path / "up.log").read_text()
