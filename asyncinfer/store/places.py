"""Where a job and the tensor store read and write: a local path, or any fsspec URL
(``s3://bucket/out.parquet``), with what they need of it: a file written whole or not at all, a
folder listed, files removed.

Written whole: locally under a temporary name, synced, then renamed (the folder synced too); in an
object store in one PUT (an object appears complete or not at all), a large one through the
store's own upload, which shows the object only once it is closed.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["Place", "place_of"]


@dataclass(frozen=True)
class Place:
    """A file or folder: its fsspec filesystem, its path there, and its URL as given."""

    fs: Any
    path: str
    url: str

    @property
    def local(self) -> bool:
        protocol = self.fs.protocol
        return (protocol if isinstance(protocol, str) else protocol[0]) in ("file", "local")

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    def child(self, name: str) -> Place:
        return Place(self.fs, posixpath.join(self.path, name), posixpath.join(self.url, name))

    def sibling(self, name: str) -> Place:
        parent, parent_url = posixpath.dirname(self.path), posixpath.dirname(self.url)
        return Place(self.fs, posixpath.join(parent, name), posixpath.join(parent_url, name))

    def exists(self) -> bool:
        self.fs.invalidate_cache(posixpath.dirname(self.path))
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def children(self) -> list[Place]:
        """What the folder holds (none when it does not exist)."""
        self.fs.invalidate_cache(self.path)
        try:
            found = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        return sorted((Place(self.fs, p, posixpath.join(self.url, posixpath.basename(p.rstrip("/"))))
                       for p in found if p.rstrip("/") != self.path.rstrip("/")),
                      key=lambda place: place.path)

    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.path, mode)  # type: ignore[no-any-return]

    def write_whole(self, data: bytes) -> None:
        """Write ``data`` as this file, whole or not at all."""
        if not self.local:
            self.fs.pipe_file(self.path, data)
            return
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        temporary = os.path.join(folder, f".{self.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(temporary, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        _sync_folder(folder)

    def remove(self) -> None:
        try:
            self.fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass


def place_of(where: str | os.PathLike[str], options: dict[str, Any] | None = None) -> Place:
    """The place ``where`` names: a local path, or an fsspec URL (``options``: fsspec's, e.g. an
    S3 server's ``endpoint_url``). ValueError naming it when fsspec cannot open it."""
    import fsspec

    text = os.fspath(where)
    try:
        fs, path = fsspec.core.url_to_fs(text, **(options or {}))
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{text!r}: fsspec cannot open it ({type(exc).__name__}: {exc})") from None
    if "://" not in text:  # a local path: absolute, so a job started again finds it
        text = path
    return Place(fs, path, text)


def _sync_folder(folder: str) -> None:
    """A rename made durable (the folder's entry synced), where the platform allows."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
