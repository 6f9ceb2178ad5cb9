"""The Ray Serve application of ``g4serve serve --ray``: N engine replicas behind an ingress that keys each
request (``affinity``) and a request router that places it (``router``).

- ``EngineReplica``: one engine and g4serve's own FastAPI app, called through a deployment handle with a
  forwarded HTTP request (``asgi_call``); one GPU (or a tensor-parallel group) each, none on CPU. Ray
  autoscales it on ongoing requests, health-checks it through the engine, and on scale-down stops routing
  to it, lets its running requests finish (``graceful_shutdown_timeout_s``), then runs the app's shutdown.
- ``AffinityRequestRouter``: Ray Serve's request-router extension point (``ray.serve.request_router``), in
  place of its default power-of-two-choices; it ranks the replicas for the request's affinity key.
- ``RouterIngress``: the HTTP ingress; reads the body under the standalone router's limits
  (``relay.RequestBodies``), computes the key, streams the chosen replica's answer back through ``relay`` (a
  replica dying mid-stream ends that stream with an error event).
"""

# No `from __future__ import annotations`: Ray pickles the deployment classes by value (their module names
# are bound to the deployments), and FastAPI resolves a string annotation such as "Request" in the
# unpickled function's globals, which hold only the names its code uses.
import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from ray.util import metrics as ray_metrics
from starlette.types import Message

from g4serve.deploy.affinity import NO_KEY, AffinityKey
from g4serve.deploy.asgi_call import AppLifespan, ForwardedRequest, call_app
from g4serve.deploy.relay import (
    ClientGone,
    ReadBody,
    RequestBodies,
    error_response,
    forwardable,
    relay,
    request_key,
    unless_client_leaves,
)
from g4serve.deploy.router import LoadBound, place, rendezvous_order
from g4serve.deploy.router_metrics import placement_label
from g4serve.server.body_budget import BodyLimits, body_limits_from_args
from g4serve.server.errors import engine_unavailable

log = logging.getLogger("g4serve.router")

AFFINITY_KWARG = "affinity"  # the handle call's keyword argument that carries the request's AffinityKey
APP_NAME = "g4serve"
# A request pinned to a replica (X-G4Serve-Replica) that has no room fails after this, rather than wait in
# Ray's routing loop for good (a pin naming no replica is answered at once: AffinityRequestRouter).
PINNED_WAIT_S = 10.0


def _affinity_of(pending_request: PendingRequest | None) -> AffinityKey:
    if pending_request is None:
        return NO_KEY
    key = pending_request.kwargs.get(AFFINITY_KWARG)
    return key if isinstance(key, AffinityKey) else NO_KEY


class AffinityRequestRouter(RequestRouter):
    """Ranks the replicas by the request's affinity key with a load bound (``router.place``); Ray then takes
    the first rank whose replica accepts (under its ``max_ongoing_requests``). The loads are Ray's cached
    queue lengths. No FIFO mixin: a replica found for one request must not go to another request."""

    _bound = LoadBound()
    _requests: ray_metrics.Counter | None = None

    def initialize_state(self, load_factor: float = 1.5, load_slack: int = 4) -> None:
        """Ray calls this with ``request_router_kwargs``."""
        self._bound = LoadBound(load_factor, load_slack)
        self._requests = ray_metrics.Counter(
            "g4serve_router_requests",
            description="Requests by replica, affinity key kind and placement (home, spilled, unkeyed)",
            tag_keys=("replica", "key", "placement"),
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {name: cache.get(replica.replica_id) or 0 for name, replica in by_name.items()}
        key = _affinity_of(pending_request)
        if key.kind == "replica" and key.value not in loads:
            # A pin naming no running replica (any client can send one): Ray retries an empty ranking in a
            # routing task of its own (two per replica) even after the ingress gave up, so eight such requests
            # stalled every later request for good. The least loaded replica takes it and answers the 503.
            key = NO_KEY
        placement = place(key, loads, self._bound)
        return [[by_name[name]] for name in placement.order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if self._requests is None:
            return
        key, name = _affinity_of(pending_request), replica_id.unique_id
        if key.kind == "replica":
            home = key.value
        else:
            ranking = rendezvous_order(key.value, [r.unique_id for r in self._replicas]) if key.routed else []
            home = ranking[0] if ranking else None
        tags = {"replica": name, "key": key.kind, "placement": placement_label(key.routed, name, home)}
        self._requests.inc(tags=tags)


@serve.deployment(name="EngineReplica")
class EngineReplica:
    """One engine with its OpenAI app; ``handle`` runs one forwarded HTTP request through the app."""

    async def __init__(self, serve_args: argparse.Namespace):
        from g4serve.server.launch import build_from_args

        self.app = build_from_args(serve_args)  # loads the model; the replica takes no request before this
        self.lifespan = AppLifespan(self.app)
        await self.lifespan.start()
        self.name = serve.get_replica_context().replica_id.unique_id

    async def handle(
        self, request: ForwardedRequest, affinity: AffinityKey = NO_KEY
    ) -> AsyncIterator[Message]:
        """The app's response messages; the first (``http.response.start``) also names this replica."""
        app = self.app
        if affinity.kind == "replica" and affinity.value != self.name:  # placed here as having no key
            refusal = f"replica {affinity.value} (X-G4Serve-Replica) is not a running replica"
            app = error_response(503, refusal)
        async for message in call_app(app, request):
            if message["type"] == "http.response.start":
                message = {**message, "replica": self.name}
            yield message

    def check_health(self) -> None:
        reason = engine_unavailable(self.app.state.engine)  # dead, or a step stalled (as GET /health)
        if reason is not None:
            raise RuntimeError(reason)

    async def __del__(self) -> None:
        # Ray has drained the replica (no new requests, running ones finished or past the grace period).
        await self.lifespan.stop()


@serve.deployment(name="Router")
@serve.ingress()
class RouterIngress:
    """The HTTP ingress: every path goes to an engine replica chosen by the request's affinity key. Each of
    its replicas (one process each) has a budget of its own for the bodies it holds."""

    def __init__(self, engine: DeploymentHandle, prefix_chars: int, body_limits: BodyLimits):
        self.engine = engine.options(stream=True)
        self.prefix_chars = prefix_chars
        self.bodies = RequestBodies(body_limits)  # no metrics of its own for the requests it refuses

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="g4serve router (Ray Serve)", openapi_url=None, docs_url=None, redoc_url=None)

        @app.get("/-/router/health")
        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
        async def forward(request: Request) -> Response:
            return await self.forward(request)

        return app

    async def forward(self, request: Request) -> Response:
        # The body counts in the budget until the answer is read whole, or its stream has begun.
        async with self.bodies.held(request) as body:
            if isinstance(body, Response):
                return body
            return await self._place(request, body)

    async def _place(self, request: Request, body: ReadBody) -> Response:
        """Key the request, call an engine replica through the affinity router, relay its answer."""
        key = request_key(request, body, self.prefix_chars)
        forwarded = ForwardedRequest(
            request.method,
            request.scope.get("raw_path", request.url.path.encode()).decode("latin-1"),
            request.url.query,
            forwardable(request.headers.items()),
            body.raw,
        )
        stream = self.engine.handle.remote(forwarded, **{AFFINITY_KWARG: key})
        try:
            first = unless_client_leaves(request, stream.__anext__())
            start = await asyncio.wait_for(first, timeout=PINNED_WAIT_S if key.kind == "replica" else None)
        except ClientGone:
            stream.cancel()
            return Response(status_code=499)  # nobody reads it
        except asyncio.TimeoutError:
            stream.cancel()
            return error_response(503, f"replica {key.value} (X-G4Serve-Replica) is not a running replica")
        except Exception as exc:  # the replica died or failed before answering
            log.warning("a replica failed before answering: %r", exc)
            return error_response(502, f"the replica failed before answering ({type(exc).__name__}); retry")
        replica = start["replica"]
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"]]

        async def chunks() -> AsyncIterator[bytes]:
            async for message in stream:
                if message["type"] == "http.response.body" and message.get("body"):
                    yield message["body"]

        def on_failure(exc: BaseException) -> None:
            log.warning("replica %s failed mid-response: %r", replica, exc)

        async def close() -> None:
            stream.cancel()  # a no-op once the stream ended; else the replica's request is aborted

        return await relay(request, start["status"], headers, chunks(), replica, on_failure, close)


def build_application(args: argparse.Namespace, gpus_per_replica: float) -> serve.Application:
    """The bound application: the ingress over ``args.num_replicas`` engine replicas built from ``args``."""
    num = args.num_replicas
    low = num if args.min_replicas is None else args.min_replicas
    high = num if args.max_replicas is None else args.max_replicas
    if not 1 <= low <= num <= high:
        raise ValueError(
            f"--min-replicas {low} <= --num-replicas {num} <= --max-replicas {high} must hold, >= 1"
        )
    engine = EngineReplica.options(
        ray_actor_options={"num_cpus": 1, "num_gpus": gpus_per_replica},
        max_ongoing_requests=args.max_ongoing_requests,
        autoscaling_config={
            "min_replicas": low,
            "initial_replicas": num,
            "max_replicas": high,
            "target_ongoing_requests": args.target_ongoing_requests,
            "upscale_delay_s": args.upscale_delay,
            "downscale_delay_s": args.downscale_delay,
        },
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=args.drain_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=AffinityRequestRouter,
            request_router_kwargs={"load_factor": args.load_factor, "load_slack": args.load_slack},
        ),
    ).bind(args)
    # the ingress relays every stream: a redeploy that replaces it lets its streams finish as the replicas do
    ingress = RouterIngress.options(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=args.drain_timeout,
    )
    return ingress.bind(engine, args.prefix_chars, body_limits_from_args(args))


def gpus_for(args: argparse.Namespace) -> float:
    if args.gpus_per_replica is not None:
        return args.gpus_per_replica
    import ray

    if args.device == "cpu" or not ray.cluster_resources().get("GPU", 0):
        return 0.0
    return float(getattr(args, "tensor_parallel_size", 1) or 1)


def serve_on_ray(args: argparse.Namespace) -> int:
    """``g4serve serve --ray``: start (or join) Ray, deploy, serve on --host:--port until interrupted."""
    import signal
    import time

    import ray

    def stop(_signum, _frame) -> None:
        raise KeyboardInterrupt  # SIGTERM (a pod stopping) shuts Serve down as Ctrl-C does

    ray.init(address=args.ray_address, include_dashboard=False)
    signal.signal(signal.SIGTERM, stop)  # after ray.init, which installs its own (an abrupt exit)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args, gpus_for(args)), name=APP_NAME, route_prefix="/")
        print(
            f"g4serve on Ray Serve: http://{args.host}:{args.port} ({args.num_replicas} replicas)", flush=True
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()  # drains the replicas (their graceful shutdown), then stops them
        ray.shutdown()
    return 0
