"""Which replica serves a request: rendezvous hashing of its affinity key over the healthy replicas, with a
load bound ("consistent hashing with bounded loads", Mirrokni, Thorup and Zadimoghaddam 2018).

Rendezvous (highest random weight) hashing ranks the replicas by ``hash(key, replica)``: a key's first
replica, its home, is the same on every router with the same replica set, and a replica joining or leaving
moves only the keys it wins or held (1/n of them), so warm caches stay warm through scaling and failures.
A home whose in-flight count is past ``factor * mean + slack`` is skipped for the next replica in the key's
ranking, which is again the same for every request of that key: a hot prefix spills onto a second warm
replica rather than onto every replica. Pure Python; the HTTP proxy and the Ray request router both use it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from g4serve.deploy.affinity import AffinityKey


@dataclass(frozen=True)
class LoadBound:
    """A replica takes a keyed request while its in-flight count, with this request, stays within
    ``factor * (in-flight everywhere + 1) / replicas + slack``."""

    # 1 + epsilon of the paper: 1.5 lets a home carry half again the mean before its keys spill.
    factor: float = 1.5
    # Requests of headroom over the bound: at low load a session's few concurrent requests stay home.
    slack: int = 4

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"load factor: must be >= 1 (got {self.factor}): below 1 no replica fits")
        if self.slack < 0:
            raise ValueError(f"load slack: must be >= 0 (got {self.slack})")

    def capacity(self, total_in_flight: int, num_replicas: int) -> float:
        return self.factor * (total_in_flight + 1) / num_replicas + self.slack


@dataclass(frozen=True)
class Placement:
    """Where one request goes: ``order`` is the replicas to try, best first (later ones are for retries
    after a connection failure); ``home`` is the key's rendezvous-first replica (None without a key)."""

    order: list[str]
    home: str | None

    @property
    def chosen(self) -> str | None:
        return self.order[0] if self.order else None

    @property
    def at_home(self) -> bool:
        return self.home is not None and self.chosen == self.home


def rendezvous_weight(key: str, replica: str) -> int:
    data = f"{key}\0{replica}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def rendezvous_order(key: str, replicas: Iterable[str]) -> list[str]:
    """The replicas by descending weight for ``key`` (ties, of probability 2^-64, by name)."""
    return sorted(replicas, key=lambda replica: (-rendezvous_weight(key, replica), replica))


def place(
    key: AffinityKey,
    loads: Mapping[str, int],
    bound: LoadBound = LoadBound(),
    rng: random.Random | None = None,
) -> Placement:
    """Place a request over the healthy replicas ``loads`` (name -> requests in flight).

    A pinned key goes to its replica or nowhere; a keyed request to the first replica of its rendezvous
    ranking within the load bound, then the rest of the ranking; a request without a key to the least
    loaded replica (ties broken at random, so idle replicas share the work).
    """
    if key.kind == "replica":
        return Placement([key.value] if key.value in loads else [], key.value)
    if not loads:
        return Placement([], None)
    if not key.routed:
        rng = rng or random
        tiebreak = {replica: rng.random() for replica in loads}
        return Placement(sorted(loads, key=lambda r: (loads[r], tiebreak[r])), None)
    ranking = rendezvous_order(key.value, loads)
    capacity = bound.capacity(sum(loads.values()), len(loads))
    within = [replica for replica in ranking if loads[replica] + 1 <= capacity]
    beyond = [replica for replica in ranking if loads[replica] + 1 > capacity]
    return Placement(within + beyond, ranking[0])
