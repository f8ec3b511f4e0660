"""Tensors too large for a message, in an object store through fsspec (``ASYNCINFER_TENSOR_STORE_URL``:
a shared folder, ``file:///shared/tensors``, ``s3://bucket/prefix``, any fsspec URL).

Objects are written under a folder named by when they expire (``<root>/expires-<epoch s>/``,
rounded up to ``bucket_s``): the request's result expiry from now. :meth:`TensorStore.sweep`
lists the root and removes the folders whose time has passed, so the store needs no index and
outlives a Redis that lost its data; any process with the store's settings may sweep (a worker
does, every ``bucket_s``). An object is written whole or not at all (store/places.py).

A worker reads only what lies under its own store's root: a request cannot make it read any
other file or URL (``owns``).
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import time
from typing import Any
from urllib.parse import quote

from asyncinfer.errors import InvalidRequest, StoreUnavailable
from asyncinfer.store.places import Place

__all__ = ["TensorStore", "store_from_settings"]

log = logging.getLogger(__name__)

_EXPIRES = "expires-"


class TensorStore:
    """The store at ``url`` (fsspec ``options``: e.g. ``{"endpoint_url": …}`` for an S3 server),
    its objects kept ``ttl_s``."""

    def __init__(self, url: str, *, ttl_s: float, options: dict[str, Any] | None = None,
                 max_read_bytes: int = 4 * 2**30) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.ttl_s = ttl_s
        self.max_read_bytes = max_read_bytes
        self.bucket_s = int(max(1, min(60, ttl_s / 10)))
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(options or {}))
        except (ImportError, ValueError) as exc:
            raise ValueError(f"ASYNCINFER_TENSOR_STORE_URL {url!r}: fsspec cannot open it "
                             f"({type(exc).__name__}: {exc})") from None
        self.root = root.rstrip("/")
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = self.protocol in ("file", "local")

    # -- writing ----------------------------------------------------------------------------------

    def write(self, request_id: str, name: str, data: bytes | memoryview) -> str:
        """Store ``data`` as ``name`` of request ``request_id``; its URL. StoreUnavailable, naming
        the store and the reason, when it cannot be written (nothing is left half-written)."""
        expires = int(math.ceil((time.time() + self.ttl_s) / self.bucket_s) * self.bucket_s)
        path = posixpath.join(self.root, f"{_EXPIRES}{expires}", quote(request_id, safe="-_."),
                              quote(name, safe="-_.") + ".bin")
        url = self._url(path)
        try:
            Place(self.fs, path, url).write_whole(bytes(data))
        except Exception as exc:  # noqa: BLE001 - every backend's own errors: said as one
            raise StoreUnavailable(f"request {request_id}: the tensor store {self.url} could not "
                                   f"take {name!r} ({len(data):,} bytes) at {url}: "
                                   f"{type(exc).__name__}: {exc}") from None
        return url

    # -- reading ----------------------------------------------------------------------------------

    def owns(self, url: str) -> bool:
        """Whether ``url`` names an object under this store's root (no ``..`` way out)."""
        path = self._path(url)
        if path is None or ".." in path.split("/"):
            return False
        return path.startswith(self.root + "/")

    def read(self, url: str, where: str, expected_bytes: int | None = None) -> bytes:
        """The object at ``url``: InvalidRequest (naming ``where``) when it is not this store's,
        is missing, or is not ``expected_bytes`` long; StoreUnavailable when the store fails."""
        if not self.owns(url):
            raise InvalidRequest(f"{where}: parameters['data_ref'] {url!r} is not in this fleet's "
                                 f"tensor store ({self.url}); a worker reads only its store")
        path = self._path(url)
        assert path is not None
        try:
            size = int(self.fs.size(path))
            if expected_bytes is not None and size != expected_bytes:
                raise InvalidRequest(f"{where}: the object at {url} holds {size:,} bytes; its "
                                     f"datatype and shape need {expected_bytes:,}")
            if size > self.max_read_bytes:
                raise InvalidRequest(f"{where}: the object at {url} holds {size:,} bytes, over "
                                     f"ASYNCINFER_TENSOR_STORE_MAX_BYTES ({self.max_read_bytes:,})")
            return bytes(self.fs.cat_file(path))
        except InvalidRequest:
            raise
        except FileNotFoundError:
            raise InvalidRequest(f"{where}: parameters['data_ref'] {url!r}: no such object (never "
                                 f"written, or expired)") from None
        except Exception as exc:  # noqa: BLE001 - every backend's own errors: said as one
            raise StoreUnavailable(f"{where}: the tensor store {self.url} could not be read at "
                                   f"{url}: {type(exc).__name__}: {exc}") from None

    # -- expiry -----------------------------------------------------------------------------------

    def sweep(self, now_s: float | None = None) -> int:
        """Remove the folders of objects whose time has passed; how many folders."""
        now_s = time.time() if now_s is None else now_s
        self.fs.invalidate_cache(self.root)  # an object store's listing may be cached
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return 0
        removed = 0
        for entry in entries:
            name = posixpath.basename(entry.rstrip("/"))
            if not name.startswith(_EXPIRES):
                continue
            try:
                expires = int(name[len(_EXPIRES):])
            except ValueError:
                continue
            if expires <= now_s:
                try:
                    self.fs.rm(entry, recursive=True)
                    removed += 1
                except FileNotFoundError:
                    pass  # another process swept it
        return removed

    # -- URLs -------------------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return f"file://{path}" if self.local else f"{self.protocol}://{path}"

    def _path(self, url: str) -> str | None:
        """The store path of ``url``, None when it is of another protocol."""
        if self.local:
            if url.startswith("file://"):
                return posixpath.normpath(url[len("file://"):])
            return posixpath.normpath(url) if url.startswith("/") else None
        prefix = f"{self.protocol}://"
        return url[len(prefix):] if url.startswith(prefix) else None


def store_from_settings(settings: Any) -> TensorStore | None:
    """The store ``settings`` name (None: none is set)."""
    if not settings.tensor_store_url:
        return None
    options = json.loads(settings.tensor_store_options) if settings.tensor_store_options else {}
    return TensorStore(settings.tensor_store_url, ttl_s=settings.result_expires_s, options=options,
                       max_read_bytes=settings.tensor_store_max_bytes)
