"""The worker's side of the response cache's generations: a model's cached answers follow its weights
(broker/response_cache.py).

- **A token per load.** When a worker loads a model whose answers are cached
  (``response_cache``), the weights it loaded get a token (:meth:`CacheGenerations.token`): a
  model file's SHA-256 (``NAME.pt`` / ``NAME.pt2``, read after the load; a file that changed
  while it loaded gets a token of its own), a fixed one for the built-ins ``identity`` and ``mlp``
  (their weights are the same in every process of a release), and otherwise a new random one at
  each load, since nothing tells what a factory's model loaded. Workers that load the same file
  share its token, and so fill and read the same entries; a factory's model is cached from the
  worker that loaded it last.
- **Generations, before routes.** Each time the worker's routes change (a load, an unload, an
  unhost of a version: worker/runtime.py), the runtime gives :meth:`CacheGenerations.changing` what
  answers each generation name now on this worker — the model (requests naming no version: its
  latest here) and each ``model@version`` — and the names that changed are recorded in Redis
  before the new routes take effect: a name set to the new token, a name no longer served here
  removed if it still holds this worker's token. From then on the look-up finds only the new
  weights' answers.
- **The token of a request's answer.** A request's cache entry ends with the token of the weights
  that run it, taken once it is routed (:meth:`CacheGenerations.entry_token`). It is given only
  when the routes have not changed since the request was taken: then the routes it went by are
  the ones read; otherwise its answer is not cached (a load is rare; one request's write is
  skipped, never one of other weights stored as these).

Kept on the Celery app (:func:`generations_of`), where the runtime (given it by the worker) and
the result writer's cache writes (given the app) both find it. A generation that could not be
recorded (Redis unreachable) is recorded again every second until it is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from asyncinfer.broker import response_cache
from asyncinfer.broker.connections import bounded_client
from asyncinfer.broker.urls import is_redis_url, shard_urls
from asyncinfer.config.bound import settings_of
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.config.settings import Settings
from asyncinfer.models.base import Model
from asyncinfer.models.builtin import MLP, Identity
from asyncinfer.models.files import FileModel

__all__ = ["CacheGenerations", "generations_of"]

log = logging.getLogger(__name__)

_ATTRIBUTE = "asyncinfer_cache_generations"
#: Between two tries to record generations Redis refused (seconds).
RETRY_S = 1.0
_CHUNK_BYTES = 1 << 20


def generations_of(app: Any) -> CacheGenerations | None:
    """The generations of ``app``'s worker (made on first use); None where the cache cannot apply
    (a broker that is no Redis, or results kept elsewhere: the publish script answers from the
    broker's Redis only)."""
    found = getattr(app, _ATTRIBUTE, None)
    if found is not None:
        return found if isinstance(found, CacheGenerations) else None
    broker = str(app.conf.broker_url or "")
    settings = settings_of(app)
    if (settings is None or not is_redis_url(broker)
            or str(app.conf.result_backend) != str(app.conf.broker_url)):
        setattr(app, _ATTRIBUTE, False)
        return None
    # on every shard a cluster URL spreads requests over: each shard's publish script reads them
    made = CacheGenerations(settings, lambda: [bounded_client(url, settings)
                                               for url in shard_urls(broker)])
    setattr(app, _ATTRIBUTE, made)
    return made


class CacheGenerations:
    """What answers each generation name on this worker, recorded in Redis (see the module).

    ``connect``: makes the broker's Redis clients (one, or one per shard of a cluster URL that
    spreads requests), on the first change to record.
    """

    def __init__(self, settings: Settings, connect: Any) -> None:
        self.settings = settings
        self._connect = connect
        self._clients: list[Any] | None = None
        self._lock = threading.Lock()
        #: Odd while the routes change; read before and after a request's token.
        self._seq = 0
        #: ``time.perf_counter()`` when the routes last finished changing.
        self._changed_at = float("-inf")
        #: Generation name → the token answering it here now.
        self._tokens: dict[str, str] = {}
        #: What this worker recorded in Redis last (name → token).
        self._recorded: dict[str, str] = {}
        self._retry: threading.Timer | None = None

    # -- at a load -------------------------------------------------------------------------------

    def caches(self, model: str) -> bool:
        """Whether ``model``'s answers are cached (``response_cache``, as the clients read it)."""
        try:
            return bool(self.settings.options_for(model, ModelOptions()).response_cache)
        except (TypeError, ValueError):
            return False

    def before_load(self, model: Model) -> Any:
        """What :meth:`token` compares after the load (a model file's state)."""
        if not isinstance(model, FileModel) or not _is_file_model(model):
            return None
        try:
            return _file_state(model.path)
        except OSError:
            return None  # no file: the load fails, and says why

    def token(self, model: Model, before: Any) -> str:
        """The token of the weights ``model`` loaded (see the module)."""
        kind = type(model)
        if kind in (Identity, MLP):
            import torch

            from asyncinfer import __version__

            return _short(f"builtin {kind.__name__} {__version__} {torch.__version__}".encode())
        if isinstance(model, FileModel) and _is_file_model(model) and before is not None:
            try:
                digest = _file_digest(model.path)
                if _file_state(model.path) == before:
                    return digest
            except OSError as exc:
                log.warning("model %s: its file could not be read again (%s); its cached answers "
                            "are its own", model.name, exc)
        return uuid.uuid4().hex

    # -- at a change of routes -------------------------------------------------------------------

    @contextmanager
    def changing(self, tokens: dict[str, str]) -> Iterator[None]:
        """Record ``tokens`` (generation name → token answering it here once the block is done),
        then run the block (the routes change), then hand out tokens by them."""
        with self._lock:
            self._seq += 1  # odd: no request's token is given meanwhile
            try:
                self._record(tokens)
                yield
            finally:
                self._tokens = dict(tokens)
                self._changed_at = time.perf_counter()
                self._seq += 1

    def _record(self, tokens: dict[str, str]) -> None:
        """(Under the lock.) Record in Redis what changed since the last record."""
        set_tokens = {n: t for n, t in tokens.items() if self._recorded.get(n) != t}
        removed = {n: t for n, t in self._recorded.items() if n not in tokens}
        if not set_tokens and not removed:
            return
        try:
            if self._clients is None:
                self._clients = self._connect()
            for client in self._clients:
                response_cache.record_generations(client, set_tokens, removed)
        except Exception as exc:  # noqa: BLE001 - the routes change all the same; retried
            log.warning("response cache: the generations of %s could not be recorded (%s); "
                        "tried again every %g s", ", ".join(sorted({**set_tokens, **removed})),
                        exc, RETRY_S)
            self._schedule_retry()
            return
        self._recorded = dict(tokens)

    def _schedule_retry(self) -> None:
        if self._retry is not None:
            return
        self._retry = threading.Timer(RETRY_S, self._record_again)
        self._retry.daemon = True
        self._retry.start()

    def _record_again(self) -> None:
        with self._lock:
            self._retry = None
            self._record(self._tokens)

    # -- at a request ----------------------------------------------------------------------------

    def entry_token(self, name: str, received_at: float) -> str:
        """The token of the weights that run a request of generation ``name`` taken at
        ``received_at`` (``time.perf_counter()``) and routed since; "" when the routes changed
        after it was taken (its answer is not cached) or nothing cached answers it here."""
        seq = self._seq
        if seq % 2 or self._changed_at >= received_at:
            return ""
        token = self._tokens.get(name, "")
        return token if self._seq == seq else ""


def _is_file_model(model: Model) -> bool:
    """A model file's model as loaded from its file (a subclass may load more than the file)."""
    return type(model) is FileModel


def _short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _file_state(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()[:32]
