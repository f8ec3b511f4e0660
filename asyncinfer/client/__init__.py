"""Producers' side: :class:`Client`, its futures and responses, the publisher, the result watcher
and the asyncio forms."""

from asyncinfer.client.client import Client
from asyncinfer.client.response_stream import AsyncResponseStream, ResponseStream
from asyncinfer.client.responses import InferFuture, InferResponse, StreamPart
from asyncinfer.client.stream_progress import Interruption

__all__ = ["Client", "InferFuture", "InferResponse", "StreamPart", "ResponseStream",
           "AsyncResponseStream", "Interruption"]
