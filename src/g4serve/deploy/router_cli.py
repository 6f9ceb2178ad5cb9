"""``g4serve router``: the flags of the standalone router and its start-up under uvicorn."""

from __future__ import annotations

import argparse

from g4serve.deploy.affinity import DEFAULT_PREFIX_CHARS
from g4serve.deploy.router import LoadBound
from g4serve.server.body_budget import BodyLimits, add_body_limit_arguments, body_limits_from_args


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    defaults = LoadBound()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, http://HOST:PORT (repeatable)",
    )
    p.add_argument(
        "--discover-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="a DNS name resolving to replica IPs (a Kubernetes headless service), re-resolved every "
        "--health-interval seconds (repeatable)",
    )
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health-check rounds")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds a replica's /health may take")
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=DEFAULT_PREFIX_CHARS,
        help="characters of the first user turn (or completion prompt) that make a request's prefix key",
    )
    p.add_argument(
        "--load-factor",
        type=float,
        default=defaults.factor,
        help="a replica takes a keyed request while its in-flight count stays within load-factor x the mean "
        "+ load-slack; past it the request goes to the key's next replica (>= 1)",
    )
    p.add_argument(
        "--load-slack", type=int, default=defaults.slack, help="requests of headroom over the bound"
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=BodyLimits().max_request_body_bytes,
        help="a request body past this gets a 413 (the router reads each body whole to key it)",
    )
    add_body_limit_arguments(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to let relayed requests finish on shutdown",
    )
    p.add_argument("--log-level", default="info")


def router_config_from_args(args: argparse.Namespace):
    from g4serve.deploy.membership import dns_target
    from g4serve.deploy.proxy import RouterConfig
    from g4serve.deploy.replica_pool import replica_url

    if not args.replica and not args.discover_dns:
        raise ValueError("give at least one --replica URL or --discover-dns NAME:PORT")
    if args.prefix_chars < 1:
        raise ValueError(f"--prefix-chars: must be >= 1 (got {args.prefix_chars})")
    return RouterConfig(
        replicas=[replica_url(text) for text in args.replica],
        dns=[dns_target(text) for text in args.discover_dns],
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        prefix_chars=args.prefix_chars,
        load_bound=LoadBound(args.load_factor, args.load_slack),
        body_limits=body_limits_from_args(args),
    )


def run_router(args: argparse.Namespace) -> int:
    from g4serve.deploy.proxy import build_router_app
    from g4serve.server.launch import log_to_stderr, run_http

    config = router_config_from_args(args)  # ValueError: main prints it and exits 2
    log_to_stderr(args.log_level)
    return run_http(build_router_app(config), args)
