"""The Redis scripts of the idle wait (wake.py): claiming, renewing, passing on and giving up the
watch of a list, and counting the consumers that wait for a list's bell."""

from __future__ import annotations

from asyncinfer.broker.scripts import script

__all__ = ["CLAIM", "CLAIM_FREE", "PASS", "RELEASE", "WAITING"]

CLAIM = script("wake_claim")
RELEASE = script("wake_release")
CLAIM_FREE = script("wake_claim_free")
WAITING = script("wake_waiting")
PASS = script("wake_pass")
