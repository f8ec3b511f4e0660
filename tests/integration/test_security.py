"""Redis with a password, with an ACL user, and over TLS: workers and clients take the credentials
from their URLs; wrong credentials are a clear error at submit."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.errors import BrokerUnavailable
from asyncinfer.ops.redis_server import RedisServer, TlsFiles, redis_server_binary, supports_tls
from tests.support.processes import start_worker

pytestmark = pytest.mark.timeout(120)

PASSWORD = "pw-" + uuid.uuid4().hex[:12]
ACL_USER, ACL_PASSWORD = "inference", "acl-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis whose default user needs a password and which has one more ACL user."""
    server = RedisServer(tmp_path_factory.mktemp("auth"), password=PASSWORD, appendonly=False,
                         acl_users=[f"{ACL_USER} on >{ACL_PASSWORD} ~* &* +@all"]).start()
    try:
        yield server
    finally:
        server.stop()


def _round_trip(url: str, log: Path, hostname: str) -> list[int]:
    """Start a worker on ``url``, send one request through a client on ``url``; its output row."""
    worker = start_worker(url, log, "--device", "cpu", "--models", "identity", "--hostname", hostname)
    try:
        with Client(broker_url=url) as client:
            got = client.infer("identity", np.array([[1, 2, 3]], np.int32), timeout_s=60)
            return list(got["input"].tolist()[0])
    finally:
        worker.stop()


def test_password_in_the_url(secured: RedisServer, tmp_path: Path) -> None:
    assert "pw-" in secured.url
    with pytest.raises(redis.AuthenticationError):  # the server really asks for it
        redis.Redis(port=secured.port).ping()
    data = _round_trip(secured.url, tmp_path / "w.log", "auth-pw@%h")
    assert data == [1, 2, 3]


def test_acl_user_in_the_url(secured: RedisServer, tmp_path: Path) -> None:
    url = secured.url_for(ACL_USER, ACL_PASSWORD)
    assert url.startswith(f"redis://{ACL_USER}:")
    admin = redis.Redis.from_url(secured.url)
    admin.acl_log_reset()
    worker = start_worker(url, tmp_path / "w.log", "--device", "cpu", "--models", "identity",
                          "--hostname", "auth-acl@%h")
    try:
        # The worker's connections are the ACL user's
        users = {c.get("user") for c in admin.client_list()}
        assert ACL_USER in users
        with Client(broker_url=url) as client:
            got = client.infer("identity", np.array([[4, 5]], np.int16), timeout_s=60)
        assert got["input"].tolist() == [[4, 5]]
        assert admin.acl_log() == []  # nothing was refused on the way
    finally:
        worker.stop()
        admin.close()


@pytest.mark.parametrize("who", ["default user", "acl user"])
def test_wrong_password_fails_at_submit_naming_the_request(secured: RedisServer, who: str) -> None:
    url = secured.url_for(None if who == "default user" else ACL_USER, "wrong")
    with Client(broker_url=url) as client:
        with pytest.raises(BrokerUnavailable, match=r"request wrong-pw-1: broker refused the "
                                                    r"credentials in the broker URL: .*"):
            client.submit("identity", np.ones((1, 2), np.float32), request_id="wrong-pw-1").sent()


def _tls_binary() -> str | None:
    for prefer_system in (False, True):
        try:
            binary = redis_server_binary(prefer_system=prefer_system)
        except FileNotFoundError:
            continue
        if supports_tls(binary):
            return binary
    return None


def test_tls_round_trip(tmp_path: Path) -> None:
    binary = _tls_binary()
    if binary is None:
        pytest.skip("no redis-server binary here was built with TLS")
    trustme = pytest.importorskip("trustme")
    # Given a throwaway CA and a TLS-only Redis whose certificate it signed
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = TlsFiles(tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem")
    cert.private_key_and_cert_chain_pem.write_to_path(str(files.cert_file))
    cert.private_key_pem.write_to_path(str(files.key_file))
    ca.cert_pem.write_to_path(str(files.ca_file))
    server = RedisServer(tmp_path / "redis", tls=files, binary=binary, password=PASSWORD,
                         appendonly=False).start()
    try:
        # When a worker and a client use its rediss:// URL (the CA named in the query)
        assert server.url.startswith("rediss://") and "ssl_cert_reqs=required" in server.url
        data = _round_trip(server.url, tmp_path / "w.log", "tls@%h")
        # Then a request makes the round trip
        assert data == [1, 2, 3]
        # And a plain connection is not served, nor a TLS one that does not trust the CA
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2).ping()
        untrusting = server.url.split("&ssl_ca_certs=")[0]
        with Client(broker_url=untrusting) as client, pytest.raises(BrokerUnavailable,
                                                                    match="request tls-1: .*certificate"):
            client.submit("identity", np.ones((1, 2), np.float32), request_id="tls-1").sent()
    finally:
        server.stop()
