"""The baseline users have today: plain Celery, one task per request, no batching.

``celery -A asyncinfer.ops.benchmark.baseline worker -P threads -c 64 -Q plain.<model>`` runs each request
through the same model code (preprocess, forward, postprocess) in Celery's own worker, one request
per call, and returns the same v2 response.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from celery import Celery

from asyncinfer.config.celery_config import celery_config
from asyncinfer.config.settings import Settings
from asyncinfer.models.base import Model
from asyncinfer.models.registry import Registry
from asyncinfer.wire.protocol import decode_request, encode_tensor, tensor_from_value

__all__ = ["app", "TASK", "QUEUE_PREFIX"]

TASK = "bench.plain_infer"
QUEUE_PREFIX = "plain."

_settings = Settings.from_env()
# Plain Celery, but it never publishes pickle either (a result's link asking for it is sent as json).
app = Celery("plain", set_as_current=False, amqp="asyncinfer.config.celery_amqp:AMQP")
app.config_from_object(celery_config(_settings))
app.conf.worker_consumer = "celery.worker.consumer:Consumer"
app.conf.worker_send_task_events = False  # plain Celery's default (asyncinfer's workers send them)



class _Models:
    """The models this worker process loaded, each once, on the CPU."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._loaded: dict[str, Model] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Model:
        with self._lock:
            if name not in self._loaded:
                model = Registry.from_config(self.settings.model_factories,
                                             self.settings.model_dir).create(name)
                model.load(torch.device("cpu"))
                self._loaded[name] = model
            return self._loaded[name]


app.plain_models = _Models(_settings)


@app.task(name=TASK, bind=True, typing=False)
def plain_infer(self: Any, **kwargs: Any) -> dict[str, Any]:
    """One request, run alone: decode, preprocess, forward, postprocess, encode."""
    request = decode_request(str(self.request.id), kwargs)
    model = self.app.plain_models.get(request.model)
    model.validate(request)
    with torch.inference_mode():
        batch = model.preprocess({t.name: t.value for t in request.inputs})
        outputs = model.postprocess(model.forward(batch))
    rows = request.inputs[0].shape[0]
    return {"model_name": request.model, "id": request.id,
            "outputs": [encode_tensor(tensor_from_value(n, v), request.binary_output)
                        for n, v in outputs.items()],
            "parameters": {"worker": self.request.hostname, "device": "cpu", "batch_size": rows}}
