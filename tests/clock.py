"""A clock a test steps by hand, for code that takes its time source as an argument (``clock=``)."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``, which only the test moves."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
