"""What a caller holds for one request: its future, and the v2 response it resolves to.

``InferFuture`` is a ``concurrent.futures.Future`` settled by the client's result watcher;
``cancel()`` revokes the request. ``InferResponse`` reads outputs as numpy arrays or torch tensors.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from celery import states
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from asyncinfer.errors import RequestTimeout
from asyncinfer.wire.payloads import output_to_numpy, output_to_torch

if TYPE_CHECKING:
    from asyncinfer.client.client import Client

__all__ = ["InferFuture", "InferResponse"]


class InferResponse:
    """A v2 inference response; ``response["output"]`` is that output as a numpy array."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = dict(raw)
        self.id: str = raw["id"]
        self.model_name: str = raw["model_name"]
        self.parameters: dict[str, Any] = dict(raw.get("parameters") or {})
        self.outputs: dict[str, dict[str, Any]] = {o["name"]: o for o in raw["outputs"]}

    def _output(self, name: str | None) -> dict[str, Any]:
        if name is None:
            return next(iter(self.outputs.values()))
        try:
            return self.outputs[name]
        except KeyError:
            raise KeyError(f"response {self.id} has no output {name!r} "
                           f"(outputs: {', '.join(self.outputs)})") from None

    def __getitem__(self, name: str) -> np.ndarray:
        return output_to_numpy(self._output(name))

    def as_numpy(self, name: str | None = None) -> np.ndarray:
        """Output ``name`` (default: the first) as a numpy array."""
        return output_to_numpy(self._output(name))

    def as_torch(self, name: str | None = None) -> Any:
        """Output ``name`` (default: the first) as a torch tensor (numeric outputs); the first
        call loads torch, which nothing else on the client's side needs."""
        return output_to_torch(self._output(name))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {o['datatype']}{o['shape']}" for n, o in self.outputs.items())
        return f"InferResponse(id={self.id!r}, model={self.model_name!r}, outputs={{{shapes}}})"


class InferFuture(concurrent.futures.Future[InferResponse]):
    """A ``concurrent.futures.Future`` for one request; ``cancel()`` revokes it in Celery."""

    def __init__(self, request_id: str, client: Client) -> None:
        super().__init__()
        self.id = request_id
        self._client = client

    @property
    def async_result(self) -> AsyncResult:
        """Celery's view of the same request."""
        return AsyncResult(self.id, app=self._client.app)

    def cancel(self) -> bool:
        """Revoke the request (it will not run if it has not started) and cancel this future."""
        if self.done():
            return False
        self._client.app.control.revoke(self.id)
        self._client.watcher.unwatch(self.id)
        return super().cancel()

    def result(self, timeout: float | None = None) -> InferResponse:
        """The response; raises the request's error, or :class:`RequestTimeout` (a
        ``TimeoutError`` naming the request) when it is not done within ``timeout`` seconds."""
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise RequestTimeout(f"request {self.id}: no result within {timeout:g} s; it may still "
                                 f"finish (look it up later by its ID)") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise RequestTimeout(f"request {self.id}: not finished within {timeout:g} s") from None

    def _settle(self, meta: dict[str, Any]) -> None:
        if self.done():
            return
        status = meta.get("status")
        if status == states.SUCCESS:
            result = meta["result"]
            is_response = isinstance(result, dict) and "outputs" in result and "id" in result
            self.set_result(InferResponse(result) if is_response else result)
        elif status == states.REVOKED:
            stored = self._client.app.backend.exception_to_python(meta.get("result"))
            self.set_exception(stored if isinstance(stored, TaskRevokedError)
                               else TaskRevokedError(f"request {self.id} was revoked"))
        else:
            self.set_exception(self._client.app.backend.exception_to_python(meta.get("result")))

    def __repr__(self) -> str:
        return f"<InferFuture {self.id} {self._state}>"
