"""The limits on the request bodies a process holds, for the API server (``guard.GuardMiddleware``) and both
routers (``deploy.relay.RequestBodies``): a cap per body, a budget over all bodies held at once, and a
deadline for a body to arrive. Their flags, and the budget. Standard library only: the CLI imports it to
build its parsers."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


def default_buffered_body_bytes(max_request_body_bytes: int) -> int:
    """--max-buffered-body-bytes unless given: four bodies at the cap, and no less than at the default cap
    (256 MiB), so that raising the cap never makes the default refuse to start, and lowering it does not
    shrink the room many small bodies share."""
    return max(4 * max_request_body_bytes, 4 * BodyLimits.max_request_body_bytes)


@dataclass(frozen=True)
class BodyLimits:
    """The flags of ``add_body_limit_arguments`` (and ``--max-request-body-bytes``), their defaults here."""

    max_request_body_bytes: int = 64 << 20
    # Bytes of request bodies held at once over all requests (--max-buffered-body-bytes): four at the cap
    # (``default_buffered_body_bytes``).
    max_buffered_body_bytes: int = 256 << 20
    # Seconds from a request's headers to the end of its body (--request-body-timeout): a body at the cap
    # needs 1.1 MB/s.
    request_body_timeout_s: float = 60.0


def add_body_limit_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The budget and the deadline, for ``g4serve serve`` (the server, and with ``--ray`` each ingress
    replica too) and ``g4serve router``; ``--max-request-body-bytes`` is each command's own."""
    defaults = BodyLimits()
    p.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        default=None,
        help="bytes of request bodies one process (server, router) holds at once over all requests while "
        "it reads and prepares them; a body that does not fit in what is left gets a 503 with Retry-After "
        "(>= --max-request-body-bytes; default: 4 x --max-request-body-bytes, at least "
        f"{defaults.max_buffered_body_bytes >> 20} MiB)",
    )
    p.add_argument(
        "--request-body-timeout",
        type=float,
        default=defaults.request_body_timeout_s,
        help="seconds a client has to send a request's whole body after its headers; then a 408 and the "
        "connection is closed",
    )


def body_limits_from_args(args: argparse.Namespace) -> BodyLimits:
    cap, buffered = args.max_request_body_bytes, args.max_buffered_body_bytes
    if buffered is None:
        buffered = default_buffered_body_bytes(cap)
    limits = BodyLimits(cap, buffered, args.request_body_timeout)
    check_body_limits(limits)
    return limits


def check_body_limits(limits: BodyLimits) -> None:
    """A ``ValueError`` naming the flag for limits that could never serve a body at the cap."""
    if limits.max_buffered_body_bytes < limits.max_request_body_bytes:
        raise ValueError(
            f"--max-buffered-body-bytes: must be >= --max-request-body-bytes "
            f"({limits.max_request_body_bytes}; got {limits.max_buffered_body_bytes}): a body at the cap "
            "would never fit"
        )
    if limits.request_body_timeout_s <= 0:
        raise ValueError(f"--request-body-timeout: must be > 0 seconds (got {limits.request_body_timeout_s})")


class OverBudget(Exception):
    """The request's body does not fit in what is left of the budget."""


class BodyBudget:
    """One per process (the server's app, a router); all its requests run on one event loop, so the count
    needs no lock."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    @contextlib.contextmanager
    def claim(self) -> Iterator[BodyClaim]:
        """A request's share, given back whole when the block ends, however it ends (or before, by
        ``BodyClaim.release``)."""
        claim = BodyClaim(self)
        try:
            yield claim
        finally:
            claim.release()


class BodyClaim:
    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0
        self.released = False

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all (a declared Content-Length, or what arrived so far); ``OverBudget``
        if the budget has not that much left. A released claim holds nothing more."""
        extra = size - self.bytes
        if extra <= 0 or self.released:
            return
        if self.budget.held_bytes + extra > self.budget.limit_bytes:
            raise OverBudget
        self.budget.held_bytes += extra
        self.bytes = size

    def release(self) -> None:
        """Give the share back now (the server: its request is in the engine); idempotent."""
        self.budget.held_bytes -= self.bytes
        self.bytes = 0
        self.released = True
