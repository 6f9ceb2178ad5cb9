"""The assistant's access flags (session secret, operator key, origins, CORS, rate limits, test login) and
``g4serve assistant mint-token``. Argparse only at import time: ``g4serve --help`` builds these without the
assistant extra."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from pathlib import Path

from g4serve.server.body_budget import add_body_limit_arguments, body_limits_from_args
from g4serve_assistant.limits import MAX_REQUEST_BODY_BYTES

log = logging.getLogger("g4serve_assistant")

SECRET_ENV = "G4SERVE_ASSISTANT_SECRET"
ADMIN_KEY_ENV = "G4SERVE_ASSISTANT_ADMIN_KEY"


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access (docs/assistant.md, Threat model)")
    g.add_argument(
        "--session-secret-file",
        default=None,
        help=f"file holding the secret (>= 32 bytes) that signs customer session tokens, shared with the "
        f"bank's login (or ${SECRET_ENV}); without either, a random secret of this process",
    )
    g.add_argument(
        "--admin-api-key-file",
        default=None,
        help="file holding the operator API key for /v1/assistant/admin/* and /metrics "
        f"(or ${ADMIN_KEY_ENV}); without either, the admin routes are off",
    )
    g.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (scheme://host[:port]) besides the assistant's own that may call it "
        "(repeatable)",
    )
    g.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a cross-origin page of the bank that may call the API, with CORS headers; repeatable",
    )
    g.add_argument("--rate-limit-customer", type=float, default=60.0, help="turns per minute per customer")
    g.add_argument(
        "--rate-limit-ip", type=float, default=300.0, help="requests per minute per client address"
    )
    g.add_argument("--session-ttl", type=float, default=3600.0, help="seconds a server-issued session lives")
    g.add_argument("--token-ttl", type=float, default=900.0, help="seconds a token minted here lives")
    g.add_argument("--metrics-public", action="store_true", help="serve /metrics without the operator key")
    g.add_argument(
        "--test-login",
        action="store_true",
        help="serve /test-login, which signs a token for any customer without a password: demos and "
        "browser tests only (--demo turns it on)",
    )
    g.add_argument(
        "--audit-db",
        default=None,
        help="SQLite file of the hash-chained audit trail (default: the --db database; with --bank-url, "
        "<cache>/assistant/audit.db)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=MAX_REQUEST_BODY_BYTES,
        help="largest request body accepted (413 past it, before it is read)",
    )
    add_body_limit_arguments(g)


def add_mint_token_parser(sub: argparse._SubParsersAction) -> None:
    mint = sub.add_parser(
        "mint-token",
        help="print a customer session token signed with --session-secret-file (what the bank's login does)",
    )
    mint.add_argument("--customer", required=True)
    mint.add_argument("--ttl", type=float, default=900.0, help="seconds")
    # Own dest: argparse lets a subparser's default overwrite the parent's value of the same name.
    mint.add_argument(
        "--session-secret-file", dest="mint_secret_file", default=None, help="as for the assistant"
    )


def read_secret(path: str | None, env: str, what: str, min_bytes: int = 0) -> bytes | None:
    """A secret from a file (surrounding whitespace stripped) or the environment; None when neither."""
    if path is not None:
        data = Path(path).read_bytes().strip()
        source = path
    elif os.environ.get(env):
        data = os.environ[env].strip().encode()
        source = f"${env}"
    else:
        return None
    if len(data) < max(1, min_bytes):
        raise ValueError(f"{what} ({source}): at least {max(1, min_bytes)} bytes, got {len(data)}")
    return data


def access_from_args(args: argparse.Namespace, *, demo: bool = False):
    """``AccessSettings`` from the flags; the audit key is derived from the session secret (so the chain
    verifies across restarts that keep the secret)."""
    from g4serve_assistant.app import AccessSettings
    from g4serve_assistant.auth import MIN_SECRET_BYTES, TokenSigner

    secret = read_secret(args.session_secret_file, SECRET_ENV, "session secret", MIN_SECRET_BYTES)
    if secret is None:
        log.warning(
            "no --session-secret-file or $%s: tokens are signed with a random secret of this process "
            "(only /test-login and the admin route can mint them)",
            SECRET_ENV,
        )
        secret = secrets.token_bytes(32)
    admin = read_secret(args.admin_api_key_file, ADMIN_KEY_ENV, "admin API key", 16)
    test_login = bool(args.test_login or demo)
    if test_login:
        log.warning("/test-login is on: anyone who reaches this server can sign in as any customer")
    for name in ("rate_limit_customer", "rate_limit_ip", "session_ttl", "token_ttl"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
    return AccessSettings(
        TokenSigner(secret, ttl_s=args.token_ttl),
        admin_api_key=admin.decode() if admin else None,
        allowed_origins=tuple(args.allowed_origin),
        cors_origins=tuple(args.cors_origin),
        customer_rate_per_min=args.rate_limit_customer,
        customer_burst=max(1, int(args.rate_limit_customer // 3)),
        ip_rate_per_min=args.rate_limit_ip,
        ip_burst=max(1, int(args.rate_limit_ip // 5)),
        session_ttl_s=args.session_ttl,
        metrics_public=args.metrics_public,
        test_login=test_login,
        body_limits=body_limits_from_args(args),
    ), audit_key(secret if args.session_secret_file or os.environ.get(SECRET_ENV) else None)


def audit_key(secret: bytes | None) -> bytes | None:
    import hashlib
    import hmac

    return (
        None
        if secret is None
        else hmac.new(secret, b"g4serve-assistant audit chain", hashlib.sha256).digest()
    )


def mint_token(args: argparse.Namespace) -> int:
    from g4serve_assistant.auth import MIN_SECRET_BYTES, TokenSigner

    path = getattr(args, "mint_secret_file", None) or args.session_secret_file
    secret = read_secret(path, SECRET_ENV, "session secret", MIN_SECRET_BYTES)
    if secret is None:
        raise ValueError(f"mint-token: needs --session-secret-file or ${SECRET_ENV} (the server's secret)")
    print(TokenSigner(secret).mint(args.customer, args.ttl))
    return 0
