"""A group of publish commands sent on one pooled connection in one write, their replies read in
order: what redis-py's ``Pipeline.execute(raise_on_error=False)`` does for the three commands a
group holds (EVALSHA, EVAL, LPUSH), without its per-call machinery.

redis-py's pipeline builds and resets its command stack, wraps the send in its retry and
observability layers, dispatches events and looks up the pool's name twice per ``execute``: at 8
calls in flight through the gateway that was over half of the publishing thread's profiled time
(2026-12-06). This one takes a connection from the client's pool, packs the commands with the
connection's packer, sends them, and reads one reply per command: a command Redis refused comes
back as its ``ResponseError`` in its place (NoScriptError for a script Redis lost), as
``raise_on_error=False`` gives it; a connection that fails is closed and the error raised (no
resend: a group must never be pushed twice). The connection's own hooks run as with the pipeline
(a Sentinel-managed connection leaves an old master, turns READONLY into a connection error).
"""

from __future__ import annotations

import time
from typing import Any

import redis

from asyncinfer.broker.cluster_client import SETTLE_S, SlotMoving

__all__ = ["DirectPipeline", "direct_pipeline"]


class DirectPipeline:
    """Collects commands (:meth:`evalsha`, :meth:`eval`, :meth:`lpush`); :meth:`execute` sends them."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._commands: list[tuple[Any, ...]] = []

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> None:
        self._commands.append(("EVALSHA", sha, numkeys, *keys_and_args))

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> None:  # noqa: A003 - Redis'
        self._commands.append(("EVAL", script, numkeys, *keys_and_args))

    def lpush(self, name: str, *values: Any) -> None:
        self._commands.append(("LPUSH", name, *values))

    def execute(self, raise_on_error: bool = False) -> list[Any]:
        """Each command's reply, in order (a refused command's error in its place; raised, when
        ``raise_on_error``). On a Redis Cluster shard, the commands that met their slot moving
        (they ran nowhere) are sent again where it is now, for up to ``SETTLE_S``; past that the
        first such error is raised (a ConnectionError: the others' fate is their replies')."""
        if not self._commands:
            return []
        replies: list[Any] = [None] * len(self._commands)
        pending = list(range(len(self._commands)))
        deadline, pause_s = 0.0, 0.01
        while True:
            for i, reply in zip(pending, self._send([self._commands[i] for i in pending]), strict=True):
                replies[i] = reply
            pending = [i for i in pending if isinstance(replies[i], SlotMoving)]
            if not pending:
                break
            deadline = deadline or time.monotonic() + SETTLE_S
            if time.monotonic() + pause_s > deadline:
                raise replies[pending[0]]
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.2)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, redis.ResponseError):
                    raise reply
        return replies

    def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        connection = self._pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except (redis.ResponseError, SlotMoving) as exc:
                    replies.append(exc)
            if any(isinstance(reply, SlotMoving) for reply in replies):
                connection.disconnect()  # the next connect finds the slot's master now
        except BaseException:
            connection.disconnect()  # a reply may still be on its way: never reuse the socket
            raise
        finally:
            self._pool.release(connection)
        return replies


def direct_pipeline(client: Any) -> Any:
    """A :class:`DirectPipeline` on ``client``'s pool, when ``client`` is redis-py's own client
    with a pool (not one holding a single connection, nor a test double such as fakeredis);
    else the client's own non-transactional pipeline."""
    if (isinstance(client, redis.Redis) and getattr(client, "connection", None) is None
            and not type(client).__module__.startswith("fakeredis")):
        return DirectPipeline(client.connection_pool)
    return client.pipeline(transaction=False)
