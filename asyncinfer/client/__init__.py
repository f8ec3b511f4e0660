"""Producers' side: :class:`Client`, its futures and responses, the publisher, the result watcher
and the asyncio forms."""

from asyncinfer.client.client import Client
from asyncinfer.client.responses import InferFuture, InferResponse

__all__ = ["Client", "InferFuture", "InferResponse"]
