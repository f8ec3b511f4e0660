"""Typed settings read from ``ASYNCINFER_*`` environment variables.

Every setting is one field of :class:`Settings`; its metadata holds the environment variable and the
line of documentation that docs/configuration.md's settings table shows (``asyncinfer config --table``
prints it: config/settings_report.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncinfer.broker.urls import is_redis_url
from asyncinfer.config.model_options import ModelOptions, parse_model_options
from asyncinfer.config.published import published_url
from asyncinfer.config.routes import Routes
from asyncinfer.config.setting_values import parse_value
from asyncinfer.config.setting_values import setting as _setting
from asyncinfer.config.settings_checks import check_settings

__all__ = ["Settings", "default_state_dir", "DEFAULT_BROKER_URL"]

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"


def default_state_dir() -> Path:
    """Where ``asyncinfer up`` keeps its embedded Redis (data, log) and publishes the broker URL."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "asyncinfer"


@dataclass(frozen=True)
class Settings:
    """All knobs of asyncinfer. Build with :meth:`from_env`; override with keyword arguments."""

    broker_url: str = _setting(
        "", "ASYNCINFER_BROKER_URL",
        "Broker URL (`redis://`, `rediss://`, `unix://`, `sentinel://`, `rediscluster://`, `amqp://`). "
        f"Unset: the URL that `asyncinfer up` published in the state dir, else `{DEFAULT_BROKER_URL}`. "
        "Redis Sentinel: Celery's `sentinel://[:password@]host:port;sentinel://host:port/db` (the "
        "password is the master's; the database may stand in any entry).")
    result_backend: str = _setting(
        "", "ASYNCINFER_RESULT_BACKEND",
        "Result backend URL (Redis, or `sentinel://` or `rediscluster://` as for the broker). "
        "Unset: the broker URL when it is a Redis URL.")
    broker_routes: str = _setting(
        "", "ASYNCINFER_BROKER_ROUTES",
        "Routing table of a fleet sharded by model: `MODEL=URL` entries separated by `;` (a "
        "pattern may be a glob: `resnet50=redis://a:6379/0;bert-*=redis://b:6379/0`; the first "
        "match wins; a Sentinel URL as for the broker), or `@/path/routes.json` (or any path "
        "ending `.json`) holding one JSON object of pattern → URL, in order. A model no entry "
        "matches goes to the broker URL above. Clients, the gateway and the CLI serve every "
        "route; a worker uses its models' route (all on one). Results: on each route's own Redis "
        "unless the result backend above names one for all. Unset: one broker.")
    sentinel_master: str = _setting(
        "mymaster", "ASYNCINFER_SENTINEL_MASTER",
        "Name of the master the Sentinels of a `sentinel://` URL watch (Celery's `master_name`); "
        "clients and workers follow it to the promoted replica after a failover.")
    sentinel_password: str = _setting(
        "", "ASYNCINFER_SENTINEL_PASSWORD",
        "Password of the Sentinels themselves (Celery's `sentinel_kwargs`); the master's goes in the "
        "URL. Unset: the Sentinels need none.")
    submit_replicas: int = _setting(
        0, "ASYNCINFER_SUBMIT_REPLICAS",
        "Replicas that must confirm a submit, and the result write that acknowledges a request, "
        "before either counts as done (Redis `WAIT`); fewer in time: the submit's future ends with "
        "`NotReplicated`, the worker logs it. 0: do not wait (a failover may lose the last writes).")
    submit_replicas_timeout_s: float = _setting(
        1.0, "ASYNCINFER_SUBMIT_REPLICAS_TIMEOUT_S",
        "How long one write waits for the replicas that the setting above asks for.")
    visibility_timeout_s: float = _setting(
        3600.0, "ASYNCINFER_VISIBILITY_TIMEOUT_S",
        "Seconds before an unacknowledged request is redelivered to another worker (Redis broker): "
        "the backstop behind leases (the setting below), which every worker of this release "
        "takes.")
    lease_s: float = _setting(
        10.0, "ASYNCINFER_LEASE_S",
        "Seconds a taken request is leased to its worker (Redis broker; the fast consumer and "
        "Celery's own). A live worker renews its leases every third of this, however long its kernels "
        "run; the requests of a worker that stops renewing (killed, frozen, cut off from Redis) go "
        "back to their queues for any other worker within this plus a sweep (about a second), and "
        "a worker restarted on the same host takes its predecessor's back at once. The visibility "
        "timeout stays as the backstop. 0: no leases (the visibility timeout alone).")
    max_worker_deaths: int = _setting(
        3, "ASYNCINFER_MAX_WORKER_DEATHS",
        "Worker deaths a request may see while it is on the device (it may be what kills them): "
        "after the first it runs again with the batch-mates that died with it (most deaths are "
        "the host's), after the second in a device batch of its own, after this many it fails "
        "for good with `WorkerLost` (dead-lettered where the model keeps dead letters). Below 3 "
        "it runs alone after the first. 0: deaths are not counted.")
    hang_after_s: float = _setting(
        0.0, "ASYNCINFER_HANG_AFTER_S",
        "Seconds a device batch may run before the worker counts it as hung (a kernel that blocks "
        "without an error): the batch's requests get a worker death counted, the worker gives "
        "back what it had not started, and exits to be replaced. 0: ten times the slowest batch "
        "the model finished (its warm-up included), at least 30 s. Time limits, when set, act "
        "first.")
    connect_timeout_s: float = _setting(
        5.0, "ASYNCINFER_CONNECT_TIMEOUT_S",
        "Seconds a client or worker waits to connect to the broker before it says it is unreachable.")
    result_expires_s: float = _setting(
        86400.0, "ASYNCINFER_RESULT_EXPIRES_S", "Seconds a stored result lives in the backend.")
    soft_time_limit_s: float = _setting(
        0.0, "ASYNCINFER_SOFT_TIME_LIMIT_S",
        "Celery's `task_soft_time_limit`: a request not finished this many seconds after a worker "
        "took it fails with `SoftTimeLimitExceeded` (and is retried like any transient failure). "
        "0: none. Per request: `soft_time_limit` of `apply_async`, `soft_time_limit_s` of `submit`.")
    time_limit_s: float = _setting(
        0.0, "ASYNCINFER_TIME_LIMIT_S",
        "Celery's `task_time_limit`: a request still on the device this many seconds after a worker "
        "took it fails with `TimeLimitExceeded`, and the worker process exits to be replaced (the "
        "device is wedged); its other requests go back to their queues. Keep it below the "
        "visibility timeout. 0: none.")
    max_retries: int = _setting(
        3, "ASYNCINFER_MAX_RETRIES",
        "Celery's `max_retries` of `asyncinfer.infer`: retries of a request after a transient "
        "failure (device out of memory, device runtime error, soft time limit). Bad input is never "
        "retried.")
    retry_backoff_s: float = _setting(
        1.0, "ASYNCINFER_RETRY_BACKOFF_S",
        "Celery's `retry_backoff`: retry n waits up to this × 2ⁿ seconds.")
    retry_backoff_max_s: float = _setting(
        60.0, "ASYNCINFER_RETRY_BACKOFF_MAX_S", "Celery's `retry_backoff_max`: the longest wait.")
    retry_jitter: bool = _setting(
        True, "ASYNCINFER_RETRY_JITTER",
        "Celery's `retry_jitter`: each wait is drawn uniformly from 0 to its backoff.")
    retry_budget_ratio: float = _setting(
        0.1, "ASYNCINFER_RETRY_BUDGET_RATIO",
        "Fleet-wide retry budget, kept in Redis: retries may be at most this fraction of the "
        "requests of the last one to two budget windows …")
    retry_budget_min: int = _setting(
        10, "ASYNCINFER_RETRY_BUDGET_MIN",
        "… plus this many. Past the budget a transient failure fails at once with "
        "`RetryBudgetExhausted`.")
    retry_budget_window_s: float = _setting(
        10.0, "ASYNCINFER_RETRY_BUDGET_WINDOW_S", "Length of one retry budget window.")
    submit_timeout_s: float = _setting(
        0.0, "ASYNCINFER_SUBMIT_TIMEOUT_S",
        "How long a submitted request waits for room in a full queue (`max_queue_size`) before its "
        "future ends with `QueueFull` (`future.sent()` raises it), and on RabbitMQ for a memory "
        "or disk alarm that blocks publishing to lift before `BrokerRefused`; 0: refused at once.")
    lost_after_s: float = _setting(
        30.0, "ASYNCINFER_LOST_AFTER_S",
        "A client ends the future of a request the broker lost (Redis restarted without its last "
        "writes, a failover that lost them: no result, and the trace written with the push is "
        "gone) with `RequestLost` within about this many seconds; it looks every half of this, "
        "one read per waiting request. A request merely queued or running is never declared "
        "lost. 0: no check (and no trace written for generated request IDs). Requests of other "
        "producers (Celery's `send_task`, `redis-cli`) have no trace and are not checked.")
    task_serializer: str = _setting(
        "json", "ASYNCINFER_TASK_SERIALIZER",
        "Serializer clients send requests with: `json` or `msgpack` (pickle is never accepted).")
    result_serializer: str = _setting(
        "json", "ASYNCINFER_RESULT_SERIALIZER",
        "Serializer results are stored with: `json` (readable from any language) or `msgpack`.")
    tensor_store_url: str = _setting(
        "", "ASYNCINFER_TENSOR_STORE_URL",
        "An fsspec URL of a folder (`/shared/tensors`, `file:///shared/tensors`, `s3://bucket/prefix`) "
        "where tensors over the reference threshold (below) go, the message holding their URL: a "
        "client's inputs, a worker's outputs; they expire with the result. Empty: none, every tensor "
        "rides in its message (docs/jobs.md).")
    tensor_ref_bytes: int = _setting(
        8 * 1024 * 1024, "ASYNCINFER_TENSOR_REF_BYTES",
        "With a tensor store: a tensor over this many bytes goes by reference.")
    tensor_store_options: str = _setting(
        "", "ASYNCINFER_TENSOR_STORE_OPTIONS",
        "fsspec's options for the tensor store, as a JSON object (e.g. `{\"endpoint_url\": "
        "\"http://minio:9000\", \"key\": …, \"secret\": …}` for an S3 server).")
    tensor_store_max_bytes: int = _setting(
        4 * 1024**3, "ASYNCINFER_TENSOR_STORE_MAX_BYTES",
        "The largest object a worker reads from the tensor store for one input.")
    max_payload_bytes: int = _setting(
        64 * 1024 * 1024, "ASYNCINFER_MAX_PAYLOAD_BYTES",
        "Largest request message body in bytes: a client refuses a larger request at submit, a "
        "worker fails it (naming the request and the limit) before decoding it.")
    device: str = _setting(
        "auto", "ASYNCINFER_DEVICE",
        "Device a worker binds: `auto`, `cpu`, `cuda:N`, `npu:N`.")
    models: tuple[str, ...] = _setting(
        (), "ASYNCINFER_MODELS",
        "Comma-separated models a worker hosts. Unset: those of the `infer.*` queues it consumes, "
        "else every registered model.")
    model_factories: tuple[str, ...] = _setting(
        (), "ASYNCINFER_MODEL_FACTORIES",
        "Comma-separated `name=package.module:factory` entries registering user models.")
    loadable_factories: tuple[str, ...] = _setting(
        (), "ASYNCINFER_LOADABLE_FACTORIES",
        "Comma-separated modules whose factories model control may import on a worker "
        "(`asyncinfer models load M --version V --factory pkg.mod:attr`): a module (`mymodels`), "
        "a package and all under it (`mymodels.*`), `*` (any: every producer on the broker may "
        "have the worker import a module) or `none`. Unset: the modules of the factories in "
        "ASYNCINFER_MODEL_FACTORIES, each alone.")
    model_dir: str = _setting(
        "", "ASYNCINFER_MODEL_DIR",
        "Model folder (`--model-dir`): model files (TorchScript `NAME.pt`, `torch.export` "
        "`NAME.pt2`, ONNX `NAME.onnx`) and Triton model repository folders (`NAME/config.pbtxt`, "
        "version folders `1/model.pt`, `2/model.onnx`, `3/model.py`).")
    concurrency: int = _setting(
        64, "ASYNCINFER_CONCURRENCY",
        "Requests in flight per worker (task threads on Celery's path): at least `max_batch_size`.")
    intra_op_threads: int = _setting(
        0, "ASYNCINFER_INTRA_OP_THREADS",
        "Threads of torch's intra-op pool (`torch.set_num_threads`) in a worker. 0: on a CPU device, "
        "cores // the most instances any hosted model runs (unless `OMP_NUM_THREADS` is set); on an "
        "accelerator, torch's own choice.")
    prefetch_multiplier: int = _setting(
        2, "ASYNCINFER_PREFETCH_MULTIPLIER",
        "Messages reserved per task thread; concurrency × this bounds what the batcher sees.")
    hold_batches: int = _setting(
        2, "ASYNCINFER_HOLD_BATCHES",
        "The least a device worker holds, in device batches per model instance (taken from its "
        "queues and not yet answered: on the device or waiting for it); it holds more for a fast "
        "device (the setting below), within the bound above: a worker that dies strands little, "
        "and idle workers beside it get the rest. 0: the bound above alone.")
    hold_s: float = _setting(
        0.25, "ASYNCINFER_HOLD_S",
        "Seconds of device work a device worker holds at most, by the pace its models' batches "
        "keep (the number of batches above is the least it holds): a fast device keeps enough in "
        "hand not to wait for each take, a slow one holds little that a death could strand.")
    refill_fraction: float = _setting(
        0.25, "ASYNCINFER_REFILL_FRACTION",
        "A device worker of one model that holds all it may (the two settings above), all of its "
        "queue's top priority level, takes again once this share of it is free, not at each "
        "answer: one take for several answers while a backlog waits (a take's cost to Redis is "
        "mostly its own, whatever it brings). 0: at each answer.")
    consumer: str = _setting(
        "fast", "ASYNCINFER_CONSUMER",
        "How a device worker (`asyncinfer worker`, `celery -A asyncinfer worker -Q infer.M`) takes "
        "requests on a Redis broker: `fast` (the take script: batched reads, leases, results and "
        "acks in one write) or `celery` (Celery's consumer receives each message through kombu, "
        "as on RabbitMQ). Either way the same pipeline runs them.")
    model_options: str = _setting(
        "", "ASYNCINFER_MODEL_OPTIONS",
        "JSON object of model → batching options overriding the model's defaults: "
        "`max_batch_size`, `max_delay_ms`, `preferred_batch_sizes`, `instances`, `pipelined`, "
        "`max_queue_size` (requests waiting in the model's queue at most, checked at submit; 0: no "
        "bound), `dead_letter` (keep requests that fail for good in `asyncinfer:dead:<model>`), "
        "`dead_letter_max_entries` (10000), `dead_letter_ttl_s` (7 days; 0: never expire), "
        "`warmup` (run one batch of each size before serving; default true), `compile` "
        "(`\"torchscript\"`: trace the forward at load, checked against eager), `group_by_cost` "
        "(batch rows of like length together when the model says what a row costs, as MiniLM "
        "does; default true), `max_cost_ratio` (rows in one such batch cost within this ratio "
        "of each other; default 1.25 on a CPU, 2 on an accelerator), `graph_batch_sizes` (capture "
        "one CUDA / NPU graph of the forward per "
        "size at load and run each batch padded to the nearest; larger batches eager; ignored on "
        "CPU; default none), `response_cache` (answer a repeated request of a deterministic "
        "model from Redis, looked up at submit: clients read it too; default false), "
        "`response_cache_ttl_s` (600), `response_cache_max_entries` (10000), "
        "`max_priority_passes` (a batch is formed from the best Celery priority waiting first, 0 "
        "on Redis; a request passed over by this many batches counts as the best: the bound on a "
        "low level's wait in the worker; default 8), `priority_queue_policy` (Triton's: level 0, 3, 6 or 9 → "
        "`max_queue_size` of that level's list, over it QueueFull / 429, and `default_timeout_s`, "
        "the expiry of its requests sent without one; default none), `stream_max_parts` (a "
        "decoupled model's: the entries each request's stream holds at most, the oldest trimmed; "
        "default 10000); key `\"*\"` "
        "applies to every model. E.g. `{\"*\": {\"max_delay_ms\": 5}, "
        "\"mlp\": {\"max_batch_size\": 64}}`.")
    state_dir: str = _setting(
        "", "ASYNCINFER_STATE_DIR",
        "Folder for `asyncinfer up`'s embedded Redis. Unset: `$XDG_STATE_HOME/asyncinfer` "
        "or `~/.local/state/asyncinfer`.")
    redis_port: int = _setting(
        0, "ASYNCINFER_REDIS_PORT", "Port of the embedded Redis that `asyncinfer up` starts (0: a free one).")
    log_level: str = _setting("info", "ASYNCINFER_LOG_LEVEL", "Worker log level.")
    metrics_port: int = _setting(
        0, "ASYNCINFER_METRICS_PORT",
        "Port on which each worker serves Prometheus metrics at `/metrics` (`asyncinfer worker "
        "--metrics-port`); 0: not served.")
    tracing: str = _setting(
        "off", "ASYNCINFER_TRACING",
        "OpenTelemetry traces across the queue (the `tracing` extra; docs/operations.md, "
        "*Tracing*): `off` (nothing imported, nothing recorded), `otlp` (spans exported over "
        "OTLP/HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT`, default `http://localhost:4318`), `console` "
        "(spans printed as JSON lines on stdout) or `global` (spans handed to the tracer "
        "provider the application set up itself). Clients, gateways and workers each read it.")
    catalogue_ttl_s: float = _setting(
        15.0, "ASYNCINFER_CATALOGUE_TTL_S",
        "Seconds a worker's entry in the model catalogue lives; it announces its models every third "
        "of this, and a worker killed outright drops out when it passes.")
    model_retention_s: float = _setting(
        86400.0, "ASYNCINFER_MODEL_RETENTION_S",
        "A model stays known this long after a worker last announced it: a submit for a model not "
        "announced in that window is refused (`UnknownModel`), a known model with no live worker is "
        "queued. 0: never refuse. While the fleet has announced nothing at all, nothing is refused.")
    gateway_host: str = _setting(
        "127.0.0.1", "ASYNCINFER_GATEWAY_HOST", "Address the gateway (`asyncinfer gateway`) listens on.")
    http_port: int = _setting(
        8000, "ASYNCINFER_HTTP_PORT", "The gateway's v2 HTTP/REST port (0: not served).")
    grpc_port: int = _setting(
        8001, "ASYNCINFER_GRPC_PORT", "The gateway's v2 gRPC port (0: not served).")
    gateway_metrics_port: int = _setting(
        8002, "ASYNCINFER_GATEWAY_METRICS_PORT",
        "Port of the gateway's Prometheus metrics at `/metrics` (0: not served).")
    model_control_mode: str = _setting(
        "none", "ASYNCINFER_MODEL_CONTROL_MODE",
        "Whether the gateway serves repository load and unload (Triton's `--model-control-mode`; "
        "`asyncinfer gateway --model-control-mode`, `asyncinfer up --model-control-mode`): "
        "`none` refuses them (HTTP 400, gRPC `UNAVAILABLE`, Triton's words), `explicit` serves "
        "them. The repository index is served either way; `asyncinfer models load|unload` and "
        "`Client.load_model` / `unload_model` do not go through a gateway.")
    gateway: bool = _setting(
        True, "ASYNCINFER_GATEWAY", "Whether `asyncinfer up` starts a gateway (`up --no-gateway`).")
    gateway_processes: int = _setting(
        0, "ASYNCINFER_GATEWAY_PROCESSES",
        "Processes the gateway serves from (`asyncinfer gateway --processes`, `asyncinfer up "
        "--gateway-processes`): N supervised processes share the HTTP and gRPC ports "
        "(SO_REUSEPORT; one that dies is restarted; process i serves metrics on the metrics port "
        "+ i). 0: one process, and a port another process holds is an error.")
    gateway_header_timeout_s: float = _setting(
        10.0, "ASYNCINFER_GATEWAY_HEADER_TIMEOUT_S",
        "Seconds an HTTP caller of the gateway has to send a request's headers, counted from "
        "connecting (or from the first byte of a later request on a kept-alive connection); "
        "past it the connection is closed, so a caller that sends nothing, or a byte a second, "
        "holds no socket for long. Also gRPC's connection handshake timeout.")
    gateway_body_timeout_s: float = _setting(
        60.0, "ASYNCINFER_GATEWAY_BODY_TIMEOUT_S",
        "Seconds an HTTP caller of the gateway has to send a request's body once its headers are "
        "in; past it the connection is closed and the call dropped.")
    gateway_max_connections: int = _setting(
        0, "ASYNCINFER_GATEWAY_MAX_CONNECTIONS",
        "Connections each front of a gateway process holds at most (HTTP, and gRPC). At the cap a "
        "new HTTP connection closes the longest-idle one not in a request (none: the newcomer "
        "gets a 503); gRPC refuses it. 0: from the open-files limit (which the gateway raises to "
        "its hard limit at start), less a reserve for Redis, files and accepts in flight: "
        "three quarters to HTTP, a quarter to gRPC.")
    allow_client_shm: bool = _setting(
        False, "ASYNCINFER_ALLOW_CLIENT_SHM",
        "Whether the gateway lets callers register system shared-memory regions (Triton's "
        "`--allow-client-shm`; `asyncinfer gateway --allow-client-shm`): a same-host caller's "
        "tensors then travel through POSIX shared memory instead of the request body. Off by "
        "default, as in Triton: a registered key gives its caller read and write access to that "
        "shared-memory object as the gateway's user.")
    send_events: bool = _setting(
        True, "ASYNCINFER_SEND_EVENTS",
        "Workers send Celery task events (Celery's `worker_send_task_events`, `-E`), so Flower and "
        "`celery events` see every request.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every ``ASYNCINFER_*`` variable; keyword arguments that are not None win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["env"])
            if raw is not None and raw != "":
                values[f.name] = parse_value(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def __post_init__(self) -> None:
        check_settings(self)  # raises ValueError naming the setting and the rule

    def options_for(self, model: str, defaults: ModelOptions) -> ModelOptions:
        """Batching options of ``model``: its defaults, then ``"*"``, then its own entry."""
        table = parse_model_options(self.model_options)
        return defaults.merged(table.get("*", {})).merged(table.get(model, {}))

    @property
    def state_path(self) -> Path:
        """The state folder as a path."""
        return Path(self.state_dir) if self.state_dir else default_state_dir()

    @property
    def redis_dir(self) -> Path:
        """Where ``asyncinfer up``'s embedded Redis keeps its data and publishes its URL."""
        return self.state_path / "redis"

    def resolved_broker_url(self) -> str:
        """The configured broker URL, else the one `asyncinfer up` published, else the default."""
        if self.broker_url:
            return self.broker_url
        return published_url(self.redis_dir) or DEFAULT_BROKER_URL

    def broker_url_origin(self) -> str:
        """Where :meth:`resolved_broker_url` comes from: ``configured``, ``published`` (by a
        running ``asyncinfer up``) or ``default`` (nothing configured, no ``up`` running)."""
        if self.broker_url:
            return "configured"
        return "published" if published_url(self.redis_dir) else "default"

    def routes(self) -> Routes:
        """The routing table of ``broker_routes``, its default the :meth:`resolved_broker_url`."""
        return Routes.parse(self.broker_routes, self.resolved_broker_url())

    def for_broker(self, url: str) -> Settings:
        """These settings for the one broker ``url`` of the table (no routes): its results on
        ``url`` too, unless ``result_backend`` names one backend for all."""
        if url == self.resolved_broker_url():
            return dataclasses.replace(self, broker_routes="")  # keeps the broker URL's origin
        return dataclasses.replace(self, broker_url=url, broker_routes="")

    def for_models(self, models: tuple[str, ...] | list[str]) -> Settings:
        """These settings for a worker hosting ``models``: their one broker of the table.
        ValueError naming the models and their brokers when the table puts them on two."""
        if not self.broker_routes:
            return self
        return self.for_broker(self.routes().url_of_models(list(models)))

    def resolved_result_backend(self) -> str:
        """The configured result backend, else the broker URL when that is Redis."""
        if self.result_backend:
            return self.result_backend
        broker = self.resolved_broker_url()
        if is_redis_url(broker):
            return broker
        raise ValueError(
            f"ASYNCINFER_RESULT_BACKEND must be set when the broker is not Redis (broker: {broker})")
