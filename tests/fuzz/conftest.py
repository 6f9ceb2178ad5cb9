"""Fixtures of the fuzz suite: one live server on the tiny model for the HTTP fuzz and schemathesis tests
(the soak test starts its own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("uvicorn")

from fuzzlib import SERVER_FLAGS, server_helpers  # noqa: E402


@pytest.fixture(scope="session")
def fuzz_server(tiny_model_dir) -> Iterator:
    """A server shared by the fuzz tests (not the soak); ``RunningServer`` of tests/server/conftest.py."""
    helpers = server_helpers()
    running, thread = helpers.start_server(tiny_model_dir, *SERVER_FLAGS)
    yield running
    helpers.stop_server(running, thread)
