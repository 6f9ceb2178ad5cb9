"""The limits on the request bodies a router holds, for both routers (``proxy``, ``ray_app``): each body is
read whole to key it and held while the replica answers, under a cap per body, a budget over all bodies held
at once, and a deadline for a body to arrive. Their flags, and the budget; ``relay.RequestBodies`` reads a
body under them. Standard library only: the CLI imports it to build its parser."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class BodyLimits:
    """The flags of ``add_body_limit_arguments`` (and ``--max-request-body-bytes``), their defaults here."""

    max_request_body_bytes: int = 64 << 20
    # Bytes of request bodies held at once over all requests (--max-buffered-body-bytes): four at the cap.
    max_buffered_body_bytes: int = 256 << 20
    # Seconds from a request's headers to the end of its body (--request-body-timeout): a body at the cap
    # needs 1.1 MB/s.
    request_body_timeout_s: float = 60.0


def add_body_limit_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The budget and the deadline; ``--max-request-body-bytes`` is each command's own (``serve``'s also
    bounds each replica)."""
    defaults = BodyLimits()
    p.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        default=defaults.max_buffered_body_bytes,
        help="bytes of request bodies the router holds at once over all requests; a body that does not fit "
        "in what is left gets a 503 with Retry-After (>= --max-request-body-bytes)",
    )
    p.add_argument(
        "--request-body-timeout",
        type=float,
        default=defaults.request_body_timeout_s,
        help="seconds a client has to send a request's whole body after its headers; then a 408",
    )


def body_limits_from_args(args: argparse.Namespace) -> BodyLimits:
    if args.max_buffered_body_bytes < args.max_request_body_bytes:
        raise ValueError(
            f"--max-buffered-body-bytes: must be >= --max-request-body-bytes ({args.max_request_body_bytes}; "
            f"got {args.max_buffered_body_bytes}): a body at the cap would never fit"
        )
    if args.request_body_timeout <= 0:
        raise ValueError(f"--request-body-timeout: must be > 0 seconds (got {args.request_body_timeout})")
    return BodyLimits(args.max_request_body_bytes, args.max_buffered_body_bytes, args.request_body_timeout)


class OverBudget(Exception):
    """The request's body does not fit in what is left of the budget."""


class BodyBudget:
    """One per router process; all its requests run on one event loop, so the count needs no lock."""

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
