"""The RabbitMQ of the tests: 127.0.0.1:5672 (guest/guest, vhost ``/``) when one listens there.

A test on it skips when none listens, names its models after its run (``gated_<run>``...) so that
their queues are its own, and deletes those queues at the end (:func:`delete_queues`).

A test that changes the node itself (a memory or disk alarm, global to it) does so through
:func:`resource_alarm`, under :func:`node_lock`, and restores what it found.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["AMQP_HOST", "AMQP_PORT", "AMQP_URL", "rabbitmq_listens", "delete_queues", "amqp_url",
           "rabbitmqctl", "rabbitmqctl_missing", "node_status", "node_lock", "resource_alarm",
           "queue_depth", "queue_consumers", "NODE_LOCK_PATH", "EventTap",
           "others_consuming", "model_of_run"]

AMQP_HOST, AMQP_PORT = "127.0.0.1", 5672
AMQP_URL = f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}//"


def rabbitmq_listens() -> bool:
    """Whether something accepts connections at AMQP_HOST:AMQP_PORT."""
    try:
        with socket.create_connection((AMQP_HOST, AMQP_PORT), timeout=1.0):
            return True
    except OSError:
        return False


@contextmanager
def model_of_run(prefix: str, run: str) -> Iterator[str]:
    """A model name of this test and ``run`` (``prefix_run_xxxx``): its queue is RabbitMQ's for
    the ``with`` block, deleted at the end."""
    name = f"{prefix}_{run}_{uuid.uuid4().hex[:4]}"
    try:
        yield name
    finally:
        delete_queues([f"infer.{name}"])


def delete_queues(queues: list[str]) -> None:
    """Delete these queues and their exchanges (one never declared is skipped)."""
    from kombu import Connection

    with Connection(AMQP_URL, connect_timeout=5) as conn:
        for name, delete in [(q, d) for q in queues for d in ("queue_delete", "exchange_delete")]:
            channel = conn.channel()
            try:
                getattr(channel, delete)(name)
            except conn.channel_errors:
                pass  # NOT_FOUND: never declared; the channel is closed by the server
            finally:
                try:
                    channel.close()
                except Exception:  # noqa: BLE001 - already closed by the error above
                    pass


def amqp_url(port: int = AMQP_PORT, **query: object) -> str:
    """AMQP_URL on ``port`` (a proxy's, say), with ``query`` (``heartbeat=4``: kombu reads it)."""
    tail = "&".join(f"{k}={v}" for k, v in query.items())
    return f"amqp://guest:guest@{AMQP_HOST}:{port}//" + (f"?{tail}" if tail else "")


def rabbitmqctl(*args: str, timeout_s: float = 30.0) -> str:
    """``rabbitmqctl args`` (quiet); its output.

    Raises:
        subprocess.CalledProcessError: it failed, with its output.
    """
    done = subprocess.run(["rabbitmqctl", *args, "-q"], capture_output=True, text=True,
                          timeout=timeout_s, check=True)
    return done.stdout


def rabbitmqctl_missing() -> str | None:
    """Why ``rabbitmqctl`` cannot drive the node of AMQP_HOST (None: it can)."""
    if shutil.which("rabbitmqctl") is None:
        return "rabbitmqctl is not on PATH"
    try:
        node_status()
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return f"rabbitmqctl status failed: {exc}"
    return None


def node_status() -> dict[str, Any]:
    """``rabbitmqctl status`` as JSON: ``alarms``, ``vm_memory_high_watermark_setting``
    (``{"relative": 0.4}`` or ``{"absolute": bytes}``), ``disk_free_limit`` (bytes), ..."""
    status: dict[str, Any] = json.loads(rabbitmqctl("status", "--formatter", "json"))
    return status


#: The file whose lock a test holds while it changes the node (an alarm is the whole node's).
NODE_LOCK_PATH = Path("/tmp/asyncinfer-rabbitmq-node.lock")


@contextmanager
def node_lock(shared: bool = False) -> Iterator[None]:
    """Hold the inter-process lock of NODE_LOCK_PATH (fcntl.flock; waits for its holder):
    exclusive to raise an alarm, ``shared`` to use the node while no alarm is raised (tests that
    publish to RabbitMQ share it with each other)."""
    with open(NODE_LOCK_PATH, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alarms() -> set[str]:
    return {str(a.get("resource")) for a in node_status().get("alarms", [])}


def _wait_alarms(want: bool, resource: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (resource in _alarms()) != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"RabbitMQ's {resource} alarm not {'raised' if want else 'cleared'} "
                               f"in {timeout_s} s")
        time.sleep(0.2)


@contextmanager
def resource_alarm(resource: str) -> Iterator[None]:
    """RabbitMQ's ``memory`` or ``disk`` alarm raised for the ``with`` block (publishers blocked),
    then the setting found before restored exactly and the alarm seen cleared. Hold
    :func:`node_lock` around it: the alarm is the whole node's."""
    status = node_status()
    if resource == "memory":
        found = status["vm_memory_high_watermark_setting"]
        restore = (["set_vm_memory_high_watermark", "absolute", str(found["absolute"])]
                   if "absolute" in found else
                   ["set_vm_memory_high_watermark", repr(float(found["relative"]))])
        raise_it = ["set_vm_memory_high_watermark", "0.000001"]
    elif resource == "disk":
        restore = ["set_disk_free_limit", str(int(status["disk_free_limit"]))]
        raise_it = ["set_disk_free_limit", str(max(int(status["disk_free"]) * 10, 10**12))]
    else:
        raise ValueError(f"resource must be 'memory' or 'disk', got {resource!r}")
    try:
        rabbitmqctl(*raise_it)
        _wait_alarms(True, resource)
        yield
    finally:
        rabbitmqctl(*restore)
        _wait_alarms(False, resource)


def queue_depth(queue: str) -> tuple[int, int]:
    """(ready, unacknowledged) messages of ``queue`` ((0, 0) when it does not exist)."""
    ready, unacked, _ = _queue_fields(queue)
    return ready, unacked


def queue_consumers(queue: str) -> int:
    """How many consumers ``queue`` has (0 when it does not exist)."""
    return _queue_fields(queue)[2]


def others_consuming(own: set[str]) -> list[str]:
    """The ``infer.*`` queues but ``own`` that have consumers: another test's workers (of this
    process or another) serve on this node, and an alarm would block their publishers."""
    busy = []
    for line in rabbitmqctl("list_queues", "name", "consumers").splitlines():
        fields = line.split("\t")
        if (len(fields) == 2 and fields[0].startswith("infer.") and fields[0] not in own
                and fields[1].isdigit() and int(fields[1]) > 0):
            busy.append(fields[0])
    return busy


def _queue_fields(queue: str) -> tuple[int, int, int]:
    for line in rabbitmqctl("list_queues", "name", "messages_ready", "messages_unacknowledged",
                            "consumers").splitlines():
        fields = line.split("\t")
        if len(fields) == 4 and fields[0] == queue:
            return int(fields[1]), int(fields[2]), int(fields[3])
    return 0, 0, 0


class EventTap:
    """The task events every worker publishes on RabbitMQ (Celery's ``celeryev`` exchange), as
    a thread of its own collects them into :attr:`events` from :meth:`start` (or ``with``) to
    :meth:`close`."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="event-tap")

    def start(self) -> EventTap:
        """Bind its queue and collect from now on (waits until bound)."""
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the event tap did not start in 10 s")
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> EventTap:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def of(self, kind: str, hostname_prefix: str) -> set[str]:
        """The request IDs of the ``kind`` events (``task-succeeded``) of the workers whose
        hostname starts with ``hostname_prefix``."""
        return {str(e.get("uuid")) for e in list(self.events)
                if e.get("type") == kind and str(e.get("hostname", "")).startswith(hostname_prefix)}

    def _run(self) -> None:
        from kombu import Connection, Exchange, Queue

        queue = Queue(f"event-tap-{uuid.uuid4().hex[:8]}", Exchange("celeryev", type="topic"),
                      routing_key="task.#", auto_delete=True, exclusive=True)

        def collect(body: Any, message: Any) -> None:
            self.events += body if isinstance(body, list) else [body]

        with Connection(AMQP_URL, connect_timeout=5) as conn:
            with conn.Consumer(queue, callbacks=[collect], no_ack=True,
                               accept=["json"]):
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        conn.drain_events(timeout=0.2)
                    except TimeoutError:
                        pass
