"""The router's budget for request bodies: the bytes of bodies it holds at once over all requests in flight
(``--max-buffered-body-bytes``). It reads each body whole to key it and holds it while the replica answers,
so without one, N clients each sending a body near ``--max-request-body-bytes`` made it hold N times that."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class OverBudget(Exception):
    """The request's body does not fit in what is left of the budget."""


class BodyBudget:
    """One per router; all its requests run on one event loop, so the count needs no lock."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    @contextlib.contextmanager
    def claim(self) -> Iterator[BodyClaim]:
        """A request's share, given back whole when the block ends, however it ends."""
        claim = BodyClaim(self)
        try:
            yield claim
        finally:
            self.held_bytes -= claim.bytes


class BodyClaim:
    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all (a declared Content-Length, or what arrived so far); ``OverBudget``
        if the budget has not that much left."""
        extra = size - self.bytes
        if extra <= 0:
            return
        if self.budget.held_bytes + extra > self.budget.limit_bytes:
            raise OverBudget
        self.budget.held_bytes += extra
        self.bytes = size
