"""A separate Celery app with the callback tasks the link tests chain onto asyncinfer.infer.

It never imports asyncinfer: a user's own app, running its own worker on the queue ``callbacks``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery

URL = os.environ["ASYNCINFER_BROKER_URL"]
app = Celery("callbacks", broker=URL, backend=URL)
app.conf.update(task_serializer="json", accept_content=["json"], result_accept_content=["json"],
                worker_pool="threads", worker_concurrency=2, task_default_queue="callbacks")
store = redis.Redis.from_url(URL)


@app.task(name="tests.record_response")
def record_response(response: dict[str, Any], tag: str) -> None:
    """Link target: gets the v2 response of the request it is linked to."""
    store.rpush(f"test:linked:{tag}", json.dumps({"id": response["id"], "outputs": response["outputs"]}))


@app.task(name="tests.record_failure")
def record_failure(request_id: str, tag: str) -> None:
    """link_error target: gets the ID of the request that failed."""
    store.rpush(f"test:failed:{tag}", request_id)
