"""The broker's clock: what every deadline on the wire is set and judged against.

A request's ``expires`` and a retry's ``eta`` are absolute times written by one host and read by
another; hosts whose clocks disagree by a minute would drop requests as expired before they ran,
or hold a 3 s countdown for a minute. So producers and workers do not use their own clocks for
them: each process keeps how far its clock is from the broker's (Redis ``TIME``, measured by
``broker/clock_skew.py``) and reads the time here, on the broker's clock. Until it is measured
(or on a broker without a clock to read) the offset is 0: the host's own clock.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

__all__ = ["BROKER_CLOCK", "BrokerClock", "now_s", "now_utc"]


class BrokerClock:
    """This host's clock plus its offset from the broker's."""

    def __init__(self) -> None:
        #: The broker's clock minus this host's, in seconds (0 until measured).
        self.offset_s = 0.0
        #: Whether the offset was measured in this process.
        self.measured = False

    def now_s(self) -> float:
        """Seconds since the epoch on the broker's clock."""
        return time.time() + self.offset_s

    def set_offset_s(self, value_s: float) -> None:
        """Keep ``value_s`` (the broker's clock minus this host's) for every deadline from now."""
        self.offset_s = float(value_s)
        self.measured = True


#: The process' one: the offset is a fact of the host's clock, shared by every worker and
#: client of the process, as the clock itself is.
BROKER_CLOCK = BrokerClock()


def now_s() -> float:
    """Seconds since the epoch on the broker's clock."""
    return BROKER_CLOCK.now_s()


def now_utc() -> datetime:
    """The time on the broker's clock, timezone-aware (UTC)."""
    return datetime.fromtimestamp(BROKER_CLOCK.now_s(), timezone.utc)
