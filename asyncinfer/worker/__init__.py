"""The device worker: runtime, start-up, launch, supervision, metrics, events, request lifecycle;
``intake/`` takes requests from the broker and writes their results."""

import asyncinfer.engine  # noqa: F401 - sets OpenMP's wait policy before torch loads
