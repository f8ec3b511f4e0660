"""A request that expired or was revoked, as a Client user meets it against the session worker:
:class:`~asyncinfer.errors.RequestExpired` / :class:`~asyncinfer.errors.RequestRevoked` naming
the request, from every way of waiting (sync, ``map``, asyncio), and still Celery's
``TaskRevokedError`` for code written against Celery."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
from celery.exceptions import TaskRevokedError

from asyncinfer.errors import AsyncInferError, RequestExpired, RequestRevoked

pytestmark = pytest.mark.timeout(120)


def x(i: float) -> np.ndarray:
    return np.array([[i]], np.float32)


def assert_expired(error: BaseException, request_id: str) -> None:
    assert isinstance(error, RequestExpired), repr(error)
    assert isinstance(error, TaskRevokedError)  # what Celery's users catch, as before
    assert str(error).startswith(f"request {request_id}: expired"), str(error)
    assert isinstance(error.__cause__, TaskRevokedError)  # what the worker stored


def test_an_expired_request_raises_request_expired_from_its_future(client) -> None:
    # Given a request already expired when it reaches the worker
    future = client.submit("identity", x(1), expires=-1.0)
    # Then its future raises RequestExpired naming it
    with pytest.raises(RequestExpired) as caught:
        future.result(timeout=60)
    assert_expired(caught.value, future.id)
    assert future.async_result.state == "REVOKED"


def test_infer_and_map_raise_request_expired(client) -> None:
    rid = f"expired-{uuid.uuid4().hex}"
    with pytest.raises(RequestExpired) as caught:
        client.infer("identity", x(2), expires=-1.0, request_id=rid, timeout_s=60)
    assert_expired(caught.value, rid)
    # map: every request expired; the first raises at its turn
    responses = client.map("identity", [x(3), x(4)], expires=-1.0, timeout_s=60)
    with pytest.raises(RequestExpired, match=r"^request \S+: expired"):
        next(responses)


def test_asyncio_calls_raise_request_expired(client) -> None:
    async def main() -> list[BaseException]:
        errors: list[BaseException] = []
        rid = f"expired-a-{uuid.uuid4().hex}"
        try:
            await client.ainfer("identity", x(5), expires=-1.0, request_id=rid, timeout_s=60)
        except AsyncInferError as exc:
            errors.append(exc)
        try:
            async for _ in client.amap("identity", [x(6)], expires=-1.0, timeout_s=60):
                pass
        except AsyncInferError as exc:
            errors.append(exc)
        assert str(errors[0]).startswith(f"request {rid}: ")
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 2
    for error in errors:
        assert isinstance(error, RequestExpired) and isinstance(error, TaskRevokedError)


def test_a_revoked_request_raises_request_revoked_not_expired(client) -> None:
    # Given a request revoked before any worker ran it (Celery's revoke: the worker stores it)
    request_id = f"revoked-{uuid.uuid4().hex}"
    client.app.control.revoke(request_id)
    # Then waiting for it raises RequestRevoked naming it, not RequestExpired
    with pytest.raises(RequestRevoked) as caught:
        client.result(request_id, timeout_s=30)
    error = caught.value
    assert not isinstance(error, RequestExpired) and isinstance(error, TaskRevokedError)
    assert str(error) == f"request {request_id}: revoked"
