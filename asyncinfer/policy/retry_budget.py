"""The fleet-wide retry budget, kept in Redis so that every worker draws on the same one.

Retries may be at most ``ratio`` × the requests that arrived in the current and the previous
budget window, plus ``minimum``. Workers count first attempts as they take them
(:meth:`RetryBudget.count_requests`) and ask before each retry (:meth:`RetryBudget.spend`); when
the budget is spent a transient failure fails at once with
:class:`~asyncinfer.errors.RetryBudgetExhausted` instead of going back on the queue. This is what
keeps a failing fleet from multiplying its own load (a retry storm): with ratio 0.1, a fleet where
every request fails runs at most ~1.1 executions per request, however high ``max_retries`` is.

Keys: ``asyncinfer:retry-budget:{requests,retries}:<window number>``, each with a TTL of two
windows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from asyncinfer.broker.scripts import script
from asyncinfer.wire.keys import RETRY_BUDGET_PREFIX

__all__ = ["RetryBudget", "BudgetDecision"]


_SPEND = script("retry_budget_spend")


@dataclass(frozen=True)
class BudgetDecision:
    """How many of the retries asked for may go ahead, and the counts behind the answer."""

    granted: int
    requests: int
    spent: int


class RetryBudget:
    """Retries ≤ ``ratio`` × recent requests + ``minimum``, over windows of ``window_s``."""

    def __init__(self, client: Any, *, ratio: float, minimum: int, window_s: float) -> None:
        if not (math.isfinite(ratio) and ratio >= 0) or minimum < 0 or window_s <= 0:
            raise ValueError("retry budget: ratio >= 0, minimum >= 0 and window_s > 0 required")
        self.client = client
        self.ratio = ratio
        self.minimum = minimum
        self.window_s = window_s
        self.ttl_s = max(1, math.ceil(2 * window_s))
        self._spend = client.register_script(_SPEND)

    def _window(self, now: float | None = None) -> int:
        return int((time.time() if now is None else now) // self.window_s)

    def count_requests(self, n: int, pipe: Any = None, now: float | None = None) -> None:
        """Count ``n`` first attempts; added to ``pipe`` when given (executed by the caller)."""
        if n <= 0:
            return
        key = f"{RETRY_BUDGET_PREFIX}:requests:{self._window(now)}"
        target = pipe if pipe is not None else self.client.pipeline(transaction=False)
        target.incrby(key, n)
        target.expire(key, self.ttl_s)
        if pipe is None:
            target.execute()

    def spend(self, wanted: int, now: float | None = None) -> BudgetDecision:
        """Take up to ``wanted`` retries from the budget; the decision says how many were granted."""
        if wanted <= 0:
            return BudgetDecision(0, 0, 0)
        window = self._window(now)
        keys = [f"{RETRY_BUDGET_PREFIX}:requests:{window}", f"{RETRY_BUDGET_PREFIX}:requests:{window - 1}",
                f"{RETRY_BUDGET_PREFIX}:retries:{window}", f"{RETRY_BUDGET_PREFIX}:retries:{window - 1}"]
        granted, requests, spent = self._spend(keys=keys, args=[wanted, repr(float(self.ratio)),
                                                                 self.minimum, self.ttl_s])
        return BudgetDecision(int(granted), int(requests), int(spent))

    def describe(self, decision: BudgetDecision) -> str:
        """Why a retry was refused, for the error message."""
        return (f"the fleet's retry budget is spent: {decision.spent} retries against "
                f"{decision.requests} requests in the last {self.window_s:g}-{2 * self.window_s:g} s "
                f"(budget: {self.ratio:g} × requests + {self.minimum}; ASYNCINFER_RETRY_BUDGET_*)")
