"""The ``--ray`` flags of ``g4serve serve`` and the switch between uvicorn and Ray Serve. Ray is imported
only when ``--ray`` is given, so ``g4serve`` runs without the ``distributed`` extra."""

from __future__ import annotations

import argparse

from g4serve.deploy.affinity import DEFAULT_PREFIX_CHARS
from g4serve.deploy.router import LoadBound

DISTRIBUTED_EXTRA_HINT = "--ray needs the distributed extra: pip install 'g4serve[distributed]'"


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """Flags for the Ray Serve deployment; every other ``serve`` flag configures each replica (--host and
    --port: Ray Serve's HTTP proxy, --drain-timeout: a replica's grace period on scale-down; the body limits,
    --max-request-body-bytes, --max-buffered-body-bytes and --request-body-timeout: each ingress replica
    too)."""
    bound = LoadBound()
    group = p.add_argument_group("Ray Serve (--ray)")
    group.add_argument("--ray", action="store_true", help="serve data-parallel replicas on Ray Serve")
    group.add_argument("--ray-address", default=None, help="a Ray cluster to join (default: start one here)")
    group.add_argument("--num-replicas", type=int, default=1, help="engine replicas at start")
    group.add_argument(
        "--min-replicas", type=int, default=None, help="autoscaling floor (default: --num-replicas)"
    )
    group.add_argument(
        "--max-replicas", type=int, default=None, help="autoscaling ceiling (default: --num-replicas)"
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=32.0,
        help="requests in flight per replica that the autoscaler aims for",
    )
    group.add_argument(
        "--upscale-delay", type=float, default=30.0, help="seconds of high load before a replica is added"
    )
    group.add_argument(
        "--downscale-delay",
        type=float,
        default=600.0,
        help="seconds of low load before a replica is drained and removed (a replica is slow to start)",
    )
    group.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=256,
        help="requests one replica takes at once; Ray holds the rest until one has room",
    )
    group.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="GPUs each replica reserves (default: the tensor-parallel size; 0 with --device cpu or no GPU)",
    )
    group.add_argument("--prefix-chars", type=int, default=DEFAULT_PREFIX_CHARS, help="as `g4serve router`'s")
    group.add_argument("--load-factor", type=float, default=bound.factor, help="as `g4serve router`'s")
    group.add_argument("--load-slack", type=int, default=bound.slack, help="as `g4serve router`'s")


def serve_command(args: argparse.Namespace) -> int:
    """``g4serve serve``: one server under uvicorn, or with ``--ray`` replicas on Ray Serve."""
    if not args.ray:
        from g4serve.server.launch import serve

        return serve(args)
    try:
        from g4serve.deploy.ray_app import serve_on_ray
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "ray":
            raise
        raise ValueError(DISTRIBUTED_EXTRA_HINT) from None
    return serve_on_ray(args)
