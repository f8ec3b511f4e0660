"""A worker's sweep of the tensor store (asyncinfer/store/tensor_store.py): every ``bucket_s``
(at most a minute) it removes the folders of objects whose result expiry has passed. Every worker
of a fleet sweeps; a folder another removed first is skipped. A sweep that fails is logged and
tried again at the next; it never stops the worker serving."""

from __future__ import annotations

import logging
import threading

from asyncinfer.store.tensor_store import TensorStore

__all__ = ["TensorSweep"]

log = logging.getLogger(__name__)


class TensorSweep:
    """Sweeps ``store`` in a thread of its own until :meth:`stop`."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncinfer-tensor-sweep",
                                        daemon=True)

    def start(self) -> TensorSweep:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.store.bucket_s):
            try:
                removed = self.store.sweep()
            except Exception as exc:  # noqa: BLE001 - any backend's error: logged, tried again
                log.warning("tensor store %s: the sweep of expired objects failed (%s: %s); next "
                            "try in %d s", self.store.url, type(exc).__name__, exc,
                            self.store.bucket_s)
                continue
            if removed:
                log.info("tensor store %s: %d expired folder(s) removed", self.store.url, removed)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
