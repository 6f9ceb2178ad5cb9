"""Replica choice (``g4serve.deploy.router``): rendezvous hashing spreads keys evenly, moves only the keys of
a replica that joins or leaves, and the load bound moves a hot key to its next replica only past the bound."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from g4serve.deploy.affinity import NO_KEY, AffinityKey
from g4serve.deploy.router import LoadBound, place, rendezvous_order

REPLICAS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
KEYS = [AffinityKey("prefix", f"{i:032x}") for i in range(4000)]


def homes(replicas, keys=KEYS) -> dict[AffinityKey, str]:
    idle = dict.fromkeys(replicas, 0)
    return {key: place(key, idle).chosen for key in keys}


def test_keys_spread_evenly_over_replicas():
    counts = Counter(homes(REPLICAS).values())
    assert set(counts) == set(REPLICAS)
    expected = len(KEYS) / len(REPLICAS)
    for replica, n in counts.items():
        assert abs(n - expected) < 0.1 * expected, (replica, n)


def test_a_leaving_replica_moves_only_its_own_keys():
    before = homes(REPLICAS)
    after = homes(REPLICAS[:-1])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == REPLICAS[-1] for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k] == REPLICAS[-1])


def test_a_joining_replica_takes_about_its_share_and_nothing_else_moves():
    before = homes(REPLICAS)
    newcomer = "10.0.0.9:8000"
    after = homes([*REPLICAS, newcomer])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == newcomer for k in moved)
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.03


def test_the_order_does_not_depend_on_how_replicas_are_listed():
    key = KEYS[7]
    shuffled = REPLICAS[:]
    random.Random(1).shuffle(shuffled)
    assert rendezvous_order(key.value, REPLICAS) == rendezvous_order(key.value, shuffled)
    assert place(key, dict.fromkeys(REPLICAS, 0)) == place(key, dict.fromkeys(shuffled, 0))


def test_a_session_sticks_while_its_home_is_within_the_bound():
    key = AffinityKey("session", "ab" * 16)
    loads = dict.fromkeys(REPLICAS, 0)
    home = place(key, loads).chosen
    for _ in range(4):  # slack 4: a few concurrent requests of one session stay home at low load
        placement = place(key, loads)
        assert placement.chosen == home and placement.at_home
        loads[home] += 1


def test_past_the_bound_a_hot_key_spills_to_its_second_replica():
    bound = LoadBound(factor=1.25, slack=1)
    key = KEYS[0]
    ranking = rendezvous_order(key.value, REPLICAS)
    loads = dict.fromkeys(REPLICAS, 2)
    loads[ranking[0]] = 10  # capacity: 1.25 * (16 + 1) / 4 + 1 = 6.3
    placement = place(key, loads, bound)
    assert placement.chosen == ranking[1] and not placement.at_home and placement.home == ranking[0]
    assert placement.order[-1] == ranking[0]  # still tried last, after a connection failure elsewhere


def test_bounded_load_keeps_every_replica_under_the_bound():
    """One hot key and many cold ones placed one by one: no replica ever passes the bound's capacity."""
    bound = LoadBound(factor=1.25, slack=1)
    rng = random.Random(3)
    loads = dict.fromkeys(REPLICAS, 0)
    for i in range(2000):
        key = KEYS[0] if rng.random() < 0.7 else KEYS[rng.randrange(1, len(KEYS))]
        capacity = bound.capacity(sum(loads.values()), len(loads))
        chosen = place(key, loads, bound).chosen
        assert loads[chosen] + 1 <= capacity
        loads[chosen] += 1
        if i % 3 == 0:  # requests finish too
            busy = [r for r, n in loads.items() if n]
            loads[rng.choice(busy)] -= 1
    assert max(loads.values()) <= bound.capacity(sum(loads.values()), len(loads)) + 1


def test_requests_without_a_key_go_to_the_least_loaded():
    loads = {"a": 3, "b": 0, "c": 1}
    placement = place(NO_KEY, loads)
    assert placement.order == ["b", "c", "a"] and placement.home is None and not placement.at_home
    ties = Counter(place(NO_KEY, {"a": 0, "b": 0}, rng=random.Random(i)).chosen for i in range(200))
    assert ties["a"] > 50 and ties["b"] > 50


def test_pins_and_empty_pools():
    loads = dict.fromkeys(REPLICAS, 0)
    assert place(AffinityKey("replica", REPLICAS[2]), loads).order == [REPLICAS[2]]
    assert place(AffinityKey("replica", "gone:1"), loads).order == []
    assert place(KEYS[0], {}).chosen is None
    assert place(NO_KEY, {}).order == []


def test_load_bound_refuses_settings_that_fit_nowhere():
    with pytest.raises(ValueError, match="load factor"):
        LoadBound(factor=0.9)
    with pytest.raises(ValueError, match="slack"):
        LoadBound(slack=-1)
