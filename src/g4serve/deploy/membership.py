"""Keeping the router's replica pool current: the ``--replica`` URLs and the ``--discover-dns`` names (a
Kubernetes headless service resolves to its ready pods' IPs) are re-resolved and every replica's
``GET /health`` is checked every few seconds."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import httpx

from g4serve.deploy.replica_pool import Replica, ReplicaPool

log = logging.getLogger("g4serve.router")


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int


def dns_target(text: str) -> DnsTarget:
    """``NAME:PORT`` (``g4serve-replicas.default.svc.cluster.local:8000``)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--discover-dns: expected NAME:PORT, got {text!r}")
    return DnsTarget(host, int(port))


async def resolve(target: DnsTarget) -> list[str]:
    """The replica URLs behind a DNS name, one per address (OSError when the name does not resolve)."""
    infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    addresses = sorted({info[4][0] for info in infos})
    return [f"http://[{a}]:{target.port}" if ":" in a else f"http://{a}:{target.port}" for a in addresses]


class Membership:
    """Refreshes ``pool``: who the replicas are, and whether each answers its health check in time."""

    def __init__(
        self,
        pool: ReplicaPool,
        client: httpx.AsyncClient,
        static: list[str],
        dns: list[DnsTarget],
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
    ):
        self.pool = pool
        self.client = client
        self.static = static
        self.dns = dns
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._resolved: dict[DnsTarget, list[str]] = {}

    async def refresh(self) -> None:
        urls = list(self.static)
        for target in self.dns:
            try:
                self._resolved[target] = await resolve(target)
            except OSError as exc:
                # A DNS hiccup keeps the last answer: emptying the pool would fail every request at once.
                log.warning(
                    "--discover-dns %s:%d: %s (keeping the last answer)", target.host, target.port, exc
                )
            urls += self._resolved.get(target, [])
        self.pool.set_members(urls)
        await asyncio.gather(*(self.check(replica) for replica in self.pool.members()))

    async def check(self, replica: Replica) -> None:
        try:
            response = await self.client.get(f"{replica.url}/health", timeout=self.timeout_s)
            healthy, error = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            healthy, error = False, f"/health failed: {type(exc).__name__}"
        if healthy != replica.healthy:
            log.info(
                "replica %s is %s%s",
                replica.name,
                "healthy" if healthy else "unhealthy",
                "" if healthy else f" ({error})",
            )
        self.pool.mark(replica.name, healthy, "" if healthy else error)

    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # one bad round must not end the refreshes for good
                log.exception("refreshing the replica pool failed")
