"""The wedge alone (policy/time_limits.py): a hard time limit passed on the device fails each such
request, gives back what is held and leaves once, with the status a supervisor reads."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from asyncinfer.policy.time_limits import EXIT_WEDGED, Wedge


def test_the_first_wedge_gives_back_and_leaves_once_and_every_request_fails() -> None:
    happened: list[str] = []
    wedge = Wedge(lambda item, exc: happened.append(f"fail {item.name}"),
                  lambda: happened.append("give back"),
                  leave=lambda status: happened.append(f"leave {status}"))
    wedge(SimpleNamespace(name="a"), TimeoutError("hard limit"))
    wedge(SimpleNamespace(name="b"), TimeoutError("hard limit"))
    assert happened == ["fail a", "give back", f"leave {EXIT_WEDGED}", "fail b"]


def test_a_delayed_wedge_leaves_after_the_failure_had_time_to_be_stored() -> None:
    left = threading.Event()
    statuses: list[int] = []

    def leave(status: int) -> None:
        statuses.append(status)
        left.set()

    wedge = Wedge(lambda item, exc: None, exit_after_s=0.2, leave=leave)
    wedge(SimpleNamespace(), TimeoutError("hard limit"))
    assert statuses == []  # not yet: the failure is stored first
    assert left.wait(5) and statuses == [EXIT_WEDGED]
