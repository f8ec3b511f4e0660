"""Per-priority queue policy (Triton's ``priority_queue_policy``): for one level of a model's
queue, the most requests it may hold and the timeout its requests get by default.

A level is one of the lists kombu's Redis transport keeps a queue's messages in: priority step 0
(priorities 0-2), 3 (3-5), 6 (6-8) or 9 — ``infer.<model>`` and ``infer.<model>\\x06\\x16N``.
Configured under the model option ``priority_queue_policy``, e.g.
``{"9": {"max_queue_size": 5000, "default_timeout_s": 30}}``:

- ``max_queue_size`` (Triton's name): the level's list holds at most this many; a request to a
  full level waits its ``timeout_s`` for room, then gets QueueFull naming the level (the gateway:
  429). 0: no bound of its own (the model's ``max_queue_size`` still bounds the whole queue);
- ``default_timeout_s`` (Triton's ``default_timeout_microseconds``): a request of the level sent
  without ``expires`` gets this one; one that has not started by then is not run (Triton's
  ``timeout_action`` REJECT; a caller's own ``expires`` wins, as ``allow_timeout_override``).
  0: none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncinfer.constants import PRIORITY_STEPS, level_of

__all__ = ["LevelPolicy", "NO_POLICY", "parse_priority_policy", "policy_for"]

_KEYS = ("max_queue_size", "default_timeout_s")


@dataclass(frozen=True)
class LevelPolicy:
    """The queue policy of one priority level (0 / 0.0: none)."""

    max_queue_size: int = 0
    default_timeout_s: float = 0.0


NO_POLICY = LevelPolicy()


def parse_priority_policy(value: Any) -> tuple[tuple[int, LevelPolicy], ...]:
    """``priority_queue_policy`` from configuration (a mapping of level → policy, or what this
    returned), checked: a tuple of (level, policy) by level."""
    if isinstance(value, tuple):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"priority_queue_policy must be an object of level → policy, got {value!r}")
    levels: dict[int, LevelPolicy] = {}
    for key, policy in value.items():
        try:
            level = int(key)
        except (TypeError, ValueError):
            level = -1
        if level not in PRIORITY_STEPS:
            raise ValueError(f"priority_queue_policy: level {key!r} is not one of kombu's priority "
                             f"steps {list(PRIORITY_STEPS)} (a queue's lists on Redis)")
        if not isinstance(policy, dict) or set(policy) - set(_KEYS):
            raise ValueError(f"priority_queue_policy[{key!r}] must be an object with keys "
                             f"{list(_KEYS)}, got {policy!r}")
        size = policy.get("max_queue_size", 0)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"priority_queue_policy[{key!r}].max_queue_size must be an integer "
                             f">= 0, got {size!r}")
        timeout_s = policy.get("default_timeout_s", 0.0)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"priority_queue_policy[{key!r}].default_timeout_s must be a finite "
                             f"number >= 0, got {timeout_s!r}")
        levels[level] = LevelPolicy(size, float(timeout_s))
    return tuple(sorted(levels.items()))


def policy_for(policies: tuple[tuple[int, LevelPolicy], ...], priority: int) -> LevelPolicy:
    """The policy of the level ``priority`` goes to (none configured: no bound, no timeout)."""
    level = level_of(priority)
    return next((p for lv, p in policies if lv == level), NO_POLICY)
