"""The router's Prometheus metrics: requests by replica, affinity key and placement (the affinity hit rate
is ``placement="home"`` over the keyed requests), replica failures, and each replica's health and load."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from g4serve.deploy.replica_pool import Replica

# placement label: the keyed request went to its key's home replica, or past it (load bound, or the home
# failed to connect), or it had no key (least loaded).
HOME, SPILLED, UNKEYED = "home", "spilled", "unkeyed"


class _ReplicaCollector:
    def __init__(self, replicas: Callable[[], list[Replica]]):
        self._replicas = replicas

    def collect(self):
        healthy = GaugeMetricFamily(
            "g4serve_router_replica_healthy",
            "1 while the replica passes its health check",
            labels=["replica"],
        )
        in_flight = GaugeMetricFamily(
            "g4serve_router_replica_in_flight", "Requests the router has in flight there", labels=["replica"]
        )
        for replica in self._replicas():
            healthy.add_metric([replica.name], float(replica.healthy))
            in_flight.add_metric([replica.name], float(replica.in_flight))
        yield healthy
        yield in_flight


class RouterMetrics:
    def __init__(self, replicas: Callable[[], list[Replica]] = list):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "g4serve_router_requests",
            "Requests forwarded, by replica, affinity key kind (replica, session, prefix, none) and "
            "placement (home, spilled, unkeyed)",
            ["replica", "key", "placement"],
            registry=self.registry,
        )
        self.failures = Counter(
            "g4serve_router_replica_failures",
            "Replica failures seen by the router, by stage: connect (retried elsewhere), response (a 502) "
            "and stream (the client got an error event)",
            ["replica", "stage"],
            registry=self.registry,
        )
        self.refused = Counter(
            "g4serve_router_refused",
            "Requests the router answered itself, by status (400: no path, 408: body too slow, 413: body too "
            "large, 503: no replica or no room left for buffered bodies)",
            ["status"],
            registry=self.registry,
        )
        self.registry.register(_ReplicaCollector(replicas))

    def observe_request(self, replica: str, key_kind: str, placement: str) -> None:
        self.requests.labels(replica, key_kind, placement).inc()

    def observe_failure(self, replica: str, stage: str) -> None:
        self.failures.labels(replica, stage).inc()

    def observe_refused(self, status: int) -> None:
        self.refused.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def placement_label(key_routed: bool, replica: str, home: str | None) -> str:
    if not key_routed:
        return UNKEYED
    return HOME if replica == home else SPILLED
