"""Fixtures of the deploy tests: two fake replicas on real sockets (``fake_replicas.py``)."""

from __future__ import annotations

import pytest
from fake_replicas import Served, fake_replica


@pytest.fixture
def fake_replicas():
    """Two fake replicas, served: ``[(app, served), (app, served)]``."""
    apps = [fake_replica("a"), fake_replica("b")]
    with Served(apps[0]) as a, Served(apps[1]) as b:
        yield [(apps[0], a), (apps[1], b)]
