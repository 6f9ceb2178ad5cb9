"""The standalone router's replicas: who they are (from flags or DNS), whether they answer their health
check, and how many of the router's requests each has in flight."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Replica:
    url: str  # scheme://host:port, no trailing slash
    name: str  # host:port: the metrics label and the X-G4Serve-Replica header
    # Not routable until a health check passed: a pod that has not loaded its model yet takes no request.
    healthy: bool = False
    in_flight: int = 0
    last_error: str = ""


def replica_url(text: str) -> str:
    """``http://h1:8000`` or ``h1:8000`` as ``http://h1:8000``; ValueError naming the flag otherwise."""
    url = text.strip()
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
    ):
        raise ValueError(f"--replica: expected http://HOST:PORT, got {text!r}")
    try:
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError:
        raise ValueError(f"--replica: bad port in {text!r}") from None
    return f"{parts.scheme}://{parts.netloc}"


class ReplicaPool:
    """Membership, health and load. A replica that leaves (DNS no longer lists it) takes no new requests;
    the streams it is serving keep their own reference to it and finish or fail on their own."""

    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}  # by name

    def set_members(self, urls: list[str]) -> None:
        wanted = {urlsplit(url).netloc: url for url in urls}
        for name in list(self._replicas):
            if name not in wanted:
                del self._replicas[name]
        for name, url in wanted.items():
            if name not in self._replicas or self._replicas[name].url != url:
                self._replicas[name] = Replica(url, name)

    def members(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def healthy_loads(self) -> dict[str, int]:
        """name -> requests in flight, of the healthy replicas (what the routing policy chooses among)."""
        return {r.name: r.in_flight for r in self._replicas.values() if r.healthy}

    def mark(self, name: str, healthy: bool, error: str = "") -> None:
        replica = self._replicas.get(name)
        if replica is not None:
            replica.healthy, replica.last_error = healthy, error
