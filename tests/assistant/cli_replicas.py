"""Two assistant servers built from the same command line, as two replicas behind a load balancer: a payment
proposed on one and confirmed on the other (the shared-state tests on SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

SECRET = b"s" * 32


def pay_across_two_replicas(argv: list[str], customer_id: str, secret_file: Path):
    """Builds replicas A and B from ``argv`` (``--session-secret-file secret_file`` appended, holding
    ``SECRET``); opens a session on A, proposes "send $50 to John Smith" on B and confirms it on A, asserting
    it executed. Returns (A, B, the customer's auth headers, the confirming turn's body)."""
    from fastapi.testclient import TestClient

    from g4serve_assistant.auth import TokenSigner
    from g4serve_assistant.cli import build_from_args, build_parser

    secret_file.write_bytes(SECRET)
    argv = [*argv, "--session-secret-file", str(secret_file)]
    a, b = (TestClient(build_from_args(build_parser().parse_args(argv))) for _ in range(2))
    headers = {"authorization": f"Bearer {TokenSigner(SECRET).mint(customer_id)}"}
    session_id = a.post("/v1/assistant/sessions", json={}, headers=headers).json()["session_id"]
    turn = {"session_id": session_id, "text": "send $50 to John Smith"}
    action_id = b.post("/v1/assistant/turn", json=turn, headers=headers).json()["pending"]["action_id"]
    turn |= {"text": "yes", "action_id": action_id}
    assert a.post("/v1/assistant/turn", json=turn, headers=headers).json()["executed"]
    return a, b, headers, turn
