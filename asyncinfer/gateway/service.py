"""What the gateway does for a v2 call, whichever front (HTTP or gRPC) it came through.

An infer call becomes one ``asyncinfer.infer`` request on ``infer.<model>``, sent by the project's
own :class:`~asyncinfer.client.Client` (same ID rules, validation, queue bound and errors), and
its result is awaited without polling (the client's result watcher, which hears it on the
client's reply channel). A call is handed to the client's group publisher (its own thread, the
one the blocking ``Client`` sends through: client/grouped.py), a large one or one whose model must
be checked against the catalogue first in the loop's executor, so the event loop never waits on
Redis and does no Redis I/O per call of its own.
Model metadata and readiness come from the model catalogue (broker/catalogue.py), read at most every
``CATALOGUE_FOR_S`` in the background. With a routing table (``ASYNCINFER_BROKER_ROUTES``) the
client sends each call to its model's broker, the catalogue is every broker's merged, and the
gateway is ready while every broker answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from celery.exceptions import TaskRevokedError

from asyncinfer import errors
from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.client import aio
from asyncinfer.client.client import Client
from asyncinfer.client.model_control import UNLOAD
from asyncinfer.client.responses import InferFuture
from asyncinfer.gateway import model_config, model_control
from asyncinfer.gateway.call_errors import GatewayError, error_for, revoked_error
from asyncinfer.gateway.call_parameters import refuse_unserved
from asyncinfer.gateway.call_request import chosen_outputs, request_of, result_of
from asyncinfer.gateway.classification import classify_outputs, wants_classes
from asyncinfer.gateway.handover import Handover
from asyncinfer.gateway.model_config import SERVER_NAME
from asyncinfer.gateway.sequence_order import SequenceOrder
from asyncinfer.gateway.shared_memory import SharedMemory
from asyncinfer.gateway.shared_memory_tensors import (
    in_shared_memory,
    input_bytes,
    read_inputs,
    write_outputs,
)
from asyncinfer.gateway.tensors import InferCall, InferResult
from asyncinfer.wire import triton_words
from asyncinfer.wire.envelope import printable

__all__ = ["Service", "EXTENSIONS", "off_loop_if_large", "GATEWAY_SPAN"]

log = logging.getLogger(__name__)

#: The gateway's span of an infer call (tracing on).
GATEWAY_SPAN = "asyncinfer.gateway.infer"
#: What ``GET /v2`` and ServerMetadata advertise.
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository",
              "system_shared_memory", "classification"]
#: Data above this size (bytes) is converted off the event loop: the client's own bound for
#: encoding a request on the loop, so one size decides both.
OFF_LOOP_BYTES = aio.ON_LOOP_BYTES

T = TypeVar("T")


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in the loop's executor when it handles more than ``OFF_LOOP_BYTES`` (large
    tensors are decoded and encoded off the event loop)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class Service:
    """The gateway's calls, shared by its fronts. Start with :meth:`start` inside the loop."""

    #: Seconds a catalogue read serves metadata and readiness answers.
    CATALOGUE_FOR_S = 1.0
    #: Seconds between two broker health checks.
    HEALTH_EVERY_S = 1.0
    #: A call for a model not in the catalogue reads it again, at least this long (seconds)
    #: after the last read, and calls that miss meanwhile share that one read: a flood of unknown
    #: names reads the catalogue at most 1 / MISS_REREAD_S times a second, not once per call.
    MISS_REREAD_S = 0.05

    def __init__(self, client: Client, *, version: str = "", tracing: Any = None,
                 shared_memory: SharedMemory | None = None) -> None:
        self.client = client
        #: The system shared-memory regions callers registered (gateway/shared_memory.py).
        self.shared_memory = shared_memory or SharedMemory(allowed=False)
        self.version = version
        self._catalogue: dict[str, CatalogueEntry] = {}
        self._catalogue_at = -1e9
        self._refreshing: asyncio.Future[None] | None = None
        self._miss_read_at = -1e9
        self._broker_ok = False
        self._tasks: list[asyncio.Task[None]] = []
        self._handover: Handover | None = None
        #: Called with (call, HTTP status, seconds) after every infer call (the metrics).
        self.on_infer: Callable[[InferCall, int, float], None] = lambda call, status, seconds: None
        self.in_flight = 0
        #: A sequence's calls go to the publisher in the order they came.
        self._sequences = SequenceOrder()
        #: Set when the gateway stops: calls cut off then are not revoked.
        self.stopping = False
        #: OpenTelemetry (``ASYNCINFER_TRACING``, asyncinfer/tracing): each infer call's server
        #: span; None: off.
        self.tracing = tracing

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._check_broker()
        await self._refresh()
        self._tasks = [asyncio.create_task(self._every(self.HEALTH_EVERY_S, self._check_broker)),
                       asyncio.create_task(self._every(self.CATALOGUE_FOR_S, self._refresh))]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
        self.shared_memory.close()

    async def _every(self, period_s: float, step: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await step()
            except Exception:  # noqa: BLE001 - a probe must never end
                log.debug("gateway background step failed", exc_info=True)

    async def _off_loop(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, call)

    async def _check_broker(self) -> None:
        try:
            await self._off_loop(self.client.ping)
            if not self._broker_ok:
                log.info("gateway: broker reachable")
            self._broker_ok = True
        except errors.BrokerUnavailable as exc:
            if self._broker_ok:
                log.warning("gateway: %s", exc)
            self._broker_ok = False

    async def _refresh_once(self) -> None:
        """:meth:`_refresh`, shared by every call that asks while one is under way."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh_spaced())
        await asyncio.shield(self._refreshing)

    async def _refresh_spaced(self) -> None:
        await asyncio.sleep(max(0.0, self._miss_read_at + self.MISS_REREAD_S - time.monotonic()))
        self._miss_read_at = time.monotonic()
        await self._refresh()

    async def _refresh(self) -> None:
        try:
            self._catalogue = await self._off_loop(self._read_catalogue)
            self._catalogue_at = time.monotonic()
        except errors.BrokerUnavailable:
            pass

    def _read_catalogue(self) -> dict[str, CatalogueEntry]:
        """Every broker's catalogue (with routes, one Redis down keeps its models as last read)."""
        return self.client.models(stale_ok=True)

    # -- health and metadata ---------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Whether the gateway can reach the broker (checked every ``HEALTH_EVERY_S``)."""
        return self._broker_ok

    def known_models(self) -> list[str]:
        """The models of the last catalogue read."""
        return list(self._catalogue)

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": self.version, "extensions": list(EXTENSIONS)}

    async def entry(self, model: str, version: str = "") -> CatalogueEntry:
        """The catalogue entry of ``model`` (read again when it is not among the known ones:
        ``MISS_REREAD_S``).

        Raises:
            GatewayError: 400 for a version string that names no version; 404 when the fleet
                does not know the model, or not that version. Each message starts with
                Triton's words (wire/triton_words.py).
        """
        if version and not triton_words.is_version(version):  # checked first, as Triton does
            raise GatewayError(400, f"{triton_words.bad_version(printable(version, 40))}: a "
                                    f"version is letters and digits (model "
                                    f"'{printable(model, 100)}')")
        entry = self._catalogue.get(model)
        if entry is None:
            await self._refresh_once()
            entry = self._catalogue.get(model)
        if entry is None:
            known = ", ".join(self._catalogue) or "none"
            raise GatewayError(404, f"{triton_words.unknown_model(printable(model, 100))}: no "
                                    f"worker announced it (known: {known})")
        if version and version not in entry.versions:
            unknown = triton_words.unknown_model(model, printable(version, 40))
            raise GatewayError(404, f"{unknown}: the fleet has versions "
                                    f"{', '.join(entry.versions)} of it")
        return entry

    async def model_metadata(self, model: str, version: str = "") -> dict[str, Any]:
        """The v2 model metadata (``name``, ``versions``, ``platform``, ``inputs``, ``outputs``)."""
        return model_config.model_metadata(model, await self.entry(model, version))

    async def model_ready(self, model: str, version: str = "") -> bool:
        """Whether a live worker hosts ``model`` (False for an unknown one)."""
        try:
            entry = await self.entry(model, version)
        except GatewayError:
            return False
        return entry.ready

    async def model_config(self, model: str, version: str = "") -> dict[str, Any]:
        """Enough of Triton's ModelConfig for clients that ask: name, platform, max batch size,
        inputs and outputs (``data_type`` ``TYPE_*``, ``dims`` without the batch dimension), and
        ``model_transaction_policy.decoupled`` (True for a model that answers in steps)."""
        return model_config.model_config(model, await self.entry(model, version))

    async def model_statistics(self, model: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics (``{"model_stats": [...]}``) of ``model``, or of every model the
        fleet counted or knows (empty name), summed over the workers (broker/fleet_stats.py).

        Raises:
            GatewayError: 404 for a model the fleet does not know, or not that version.
        """
        versions = ["1"]
        if model:
            versions = (await self.entry(model, version)).versions
        try:
            stats = await self._off_loop(lambda: self.client.statistics(model or None))
        except errors.BrokerUnavailable as exc:
            raise GatewayError(503, str(exc)) from exc
        for entry in stats:
            entry["version"] = version or versions[0]
        return {"model_stats": stats}

    # -- model repository (model control: client/model_control.py) -------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every model the fleet knows or could load, per version."""
        return await model_control.repository_index(self.client, ready_only)

    async def control_model(self, action: str, model: str,
                            parameters: Mapping[str, Any]) -> dict[str, Any]:
        """Load or unload ``model`` on the fleet (Triton's RepositoryModelLoad / Unload): on the
        workers of parameter ``workers`` (comma-separated names), else every live worker (a load)
        or every worker hosting it (an unload); parameter ``timeout_s`` bounds the wait for their
        answers, ``grace_s`` (an unload) how long its requests on a device may finish.

        Raises:
            GatewayError: 400 model control not allowed (the gateway's ``model_control_mode`` is
                not ``explicit``: gRPC ``UNAVAILABLE``, as Triton answers), a parameter the
                gateway does not take, or a worker that failed (with its reason); 503 no live
                worker to load it on; 504 a worker that did not answer in time.
        """
        outcome = await model_control.send_control(self.client, action, model, parameters)
        await self._refresh()
        if outcome.ok:
            log.info("gateway: %s", outcome.message())
            return outcome.as_dict()
        status = 400 if outcome.failed or (outcome.nobody and action == UNLOAD) else \
            503 if outcome.nobody else 504
        raise GatewayError(status, outcome.message())

    # -- infer -----------------------------------------------------------------------------------

    async def infer(self, call: InferCall) -> InferResult:
        """Send ``call`` as one request and await its response.

        Raises:
            GatewayError: with the status the error maps to (404 unknown model, 400 bad input,
                429 queue full, 503 broker unreachable, 504 expired, 500 a model failure).
        """
        span = None if self.tracing is None else self._start_span(call)
        on_done = None if span is None else (lambda status: self._end_span(span, status))
        with self.accounted(call, on_done):
            return await self._infer(call)

    @contextlib.contextmanager
    def accounted(self, call: InferCall,
                  on_done: Callable[[int], None] | None = None) -> Iterator[None]:
        """Count ``call`` in flight while the block runs, and once it ends its status and time
        (``on_infer``; ``on_done(status)`` too, when given): 200, 499 when the caller went away
        (cancelled, or a stream closed early), else the status its error maps to — the error
        is raised again as that :class:`GatewayError`."""
        started = time.perf_counter()
        status = 200
        self.in_flight += 1
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is answered with its status
            error = error_for(exc)
            status = error.status
            raise error from (None if isinstance(exc, GatewayError) else exc)
        finally:
            self.in_flight -= 1
            self.on_infer(call, status, time.perf_counter() - started)
            if on_done is not None:
                on_done(status)

    def _start_span(self, call: InferCall) -> Any:
        """The call's server span, child of the caller's trace context (a new trace without
        one); the request carries the span's context on (``call.trace``)."""
        assert self.tracing is not None
        span = self.tracing.start(GATEWAY_SPAN, call.trace, kind="server", attributes={
            "rpc.system": call.protocol, "asyncinfer.model": call.model,
            "asyncinfer.model_version": call.version, "asyncinfer.call_id": call.id})
        call.trace = self.tracing.fields_of(span)
        return span

    def _end_span(self, span: Any, status: int) -> None:
        assert self.tracing is not None
        span.set_attribute("asyncinfer.status_code", status)
        if status >= 400:
            self.tracing.fail(span, f"answered {status}")
        span.end()

    async def _send(self, model: str, inputs: list[dict[str, Any]],
                    options: dict[str, Any]) -> InferFuture:
        """Hand the request to the client's group publisher (its own thread; a refusal ends the
        future, which :meth:`_infer` awaits anyway); the loop does no Redis I/O of its own. Large
        inputs are encoded, and a model not known now checked against the catalogue, in the
        executor; a broker other than Redis publishes there too (it sends before returning)."""
        sender = self.client.sender_for(model)
        if (sender.grouped is None or aio.nbytes(inputs) > aio.ON_LOOP_BYTES
                or not sender.knows_now(model)):
            return await aio.publish(sender, lambda: sender.submit(model, inputs, **options))
        return sender.submit(model, inputs, **options)

    async def submit(self, call: InferCall, entry: CatalogueEntry) -> InferFuture:
        """Check ``call`` against ``entry`` (its model's catalogue entry) and send it as one
        request; the future ends with its answer (or why it was refused).

        Raises:
            GatewayError: 400 for a call without inputs, or asking for an output the model does
                not declare, or with a bad ``priority`` or ``timeout``.
            InvalidRequest: a parameter of a feature not served (call_parameters.py), or classes
                asked of an output that has none.
        """
        refuse_unserved(call)
        if in_shared_memory(call):  # inputs read from the caller's regions, outputs' checked
            await off_loop_if_large(input_bytes(call), read_inputs, self.shared_memory, call)
        inputs, options, sequence = request_of(call, entry)
        send = functools.partial(self._send, call.model, inputs, options)
        if sequence is None:
            return await send()
        return await self._sequences.send((call.model, sequence.key), send)

    def wait(self, sent: InferFuture) -> asyncio.Future[Any]:
        """A loop future that ends as ``sent`` does (cancelling it leaves the request alone)."""
        if self._handover is None:  # the loop's, made on its first call
            self._handover = Handover(asyncio.get_running_loop())
        return self._handover.wait(sent)

    def revoke(self, sent: InferFuture) -> None:
        """Revoke ``sent`` because its caller went away (a broadcast through the broker, off the
        loop); a gateway that stops leaves its requests to run (a caller may ask again by ID)."""
        if not self.stopping:
            asyncio.get_running_loop().run_in_executor(None, sent.cancel)

    async def _infer(self, call: InferCall) -> InferResult:
        entry = await self.entry(call.model, call.version)
        sent = await self.submit(call, entry)
        try:
            response = await self.wait(sent)
        except TaskRevokedError as exc:  # the worker's answer for a revoked or expired request
            raise revoked_error(sent.id, exc) from None
        except asyncio.CancelledError:  # the caller went away
            self.revoke(sent)
            raise
        raw = response.raw
        chosen = chosen_outputs(call, raw)
        if wants_classes(call):  # Triton's classification extension (classification.py)
            chosen = await off_loop_if_large(sum(len(t.raw) for t in chosen), classify_outputs,
                                             call, entry, chosen)
        if in_shared_memory(call):  # written to the caller's regions, not the response
            chosen = await off_loop_if_large(sum(len(t.raw) for t in chosen), write_outputs,
                                             self.shared_memory, call, chosen)
        return result_of(call, entry, raw, sent.id, chosen)
