"""The client's check for requests the broker lost, as the tests read it."""

from __future__ import annotations

from asyncinfer.client import Client
from asyncinfer.client.lost_check import LostCheck

__all__ = ["lost_check_of"]


def lost_check_of(client: Client) -> LostCheck:
    """The lost check of ``client``'s result watcher (on for a Redis broker)."""
    check = client.watcher.lost_check
    assert check is not None, "the lost check is on for a Redis broker"
    return check
