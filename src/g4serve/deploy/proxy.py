"""The standalone router (``g4serve router``): an HTTP reverse proxy in front of g4serve replicas that sends
each request where its affinity key is warm (``affinity``, ``router``), without Ray.

``GET /health`` and ``GET /metrics`` are the router's own; every other path is forwarded as it came (method,
path, query, headers, body), event streams unbuffered. A replica that refuses the connection is marked
unhealthy and the request goes to the next replica of its placement; one that fails after it got the
request is not retried (it may have run it): the client gets a 502, or an error event mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from g4serve.deploy.affinity import DEFAULT_PREFIX_CHARS, REPLICA_HEADER
from g4serve.deploy.membership import DnsTarget, Membership
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
from g4serve.deploy.replica_pool import Replica, ReplicaPool
from g4serve.deploy.router import LoadBound, place
from g4serve.deploy.router_metrics import RouterMetrics, placement_label
from g4serve.server.body_budget import BodyLimits

log = logging.getLogger("g4serve.router")

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)  # replica URLs (--replica)
    dns: list[DnsTarget] = field(default_factory=list)  # headless-service names (--discover-dns)
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    load_bound: LoadBound = field(default_factory=LoadBound)
    body_limits: BodyLimits = field(default_factory=BodyLimits)
    max_connect_attempts: int = 3  # replicas tried per request when connections are refused


class RouterProxy:
    """Forwards one request: read the body, key it, place it, connect, relay the answer."""

    def __init__(self, config: RouterConfig, pool: ReplicaPool, metrics: RouterMetrics):
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.bodies = RequestBodies(config.body_limits, metrics.observe_refused)
        self.session: aiohttp.ClientSession | None = None  # opened in the app's event loop (``open``)

    def open(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,  # bytes pass through as the replica sent them
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        )

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(self, request: Request) -> Response:
        target = origin_form_target(request)
        if target is None:
            return self._refuse(400, "request target: expected a path starting with /")
        # The body counts in the budget until this block ends, which is when the router lets go of it: once a
        # non-streaming answer is read whole, or a stream has begun.
        async with self.bodies.held(request) as body:
            if isinstance(body, Response):
                return body
            return await self._place(request, target, body)

    async def _place(self, request: Request, target: str, body: ReadBody) -> Response:
        """Key the request and forward it to the first replica of its placement that takes the connection."""
        key = request_key(request, body, self.config.prefix_chars)
        placement = place(key, self.pool.healthy_loads(), self.config.load_bound)
        for name in placement.order[: self.config.max_connect_attempts]:
            replica = self.pool.get(name)
            if replica is None or not replica.healthy:  # gone since placing (a health check ran)
                continue
            response = await self._try(replica, request, target, body.raw)
            if response is not None:
                self.metrics.observe_request(
                    name, key.kind, placement_label(key.routed, name, placement.home)
                )
                return response
        if key.kind == "replica":
            return self._refuse(503, f"replica {key.value} (X-G4Serve-Replica) is not a healthy replica")
        return self._refuse(503, "no healthy replica to serve the request; retry later", {"Retry-After": "1"})

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        self.metrics.observe_refused(status)
        return error_response(status, message, headers)

    async def _try(self, replica: Replica, request: Request, target: str, body: bytes) -> Response | None:
        """The relayed answer, or None when the replica refused the connection (marked unhealthy)."""
        replica.in_flight += 1
        sent = self.session.request(
            request.method,
            replica.url + target,
            headers=forwardable(request.headers.items()),
            data=body,
            allow_redirects=False,
        )
        try:
            upstream = await unless_client_leaves(request, sent)
        except ClientGone:
            replica.in_flight -= 1
            return Response(status_code=499)  # nobody reads it
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as exc:
            # refused, or no connection within --connect-timeout
            replica.in_flight -= 1
            self.pool.mark(replica.name, False, f"connect failed: {type(exc).__name__}")
            self.metrics.observe_failure(replica.name, "connect")
            log.warning("replica %s refused a connection (%s): trying the next", replica.name, exc)
            return None
        except aiohttp.ClientError as exc:
            replica.in_flight -= 1
            self.metrics.observe_failure(replica.name, "response")
            return error_response(
                502,
                f"replica {replica.name} failed before answering ({type(exc).__name__}); retry the request",
            )

        async def close() -> None:
            replica.in_flight -= 1
            if upstream.content.at_eof():
                upstream.release()  # read whole: the connection goes back to the pool
            else:
                upstream.close()  # the client left or the replica failed: the replica sees the request end

        def on_failure(exc: BaseException) -> None:
            self.metrics.observe_failure(replica.name, "stream")
            log.warning("replica %s failed mid-response: %r", replica.name, exc)

        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in upstream.raw_headers]
        return await relay(
            request, upstream.status, headers, upstream.content.iter_any(), replica.name, on_failure, close
        )

    def health(self) -> JSONResponse:
        members = self.pool.members()
        healthy = sum(r.healthy for r in members)
        body = {"status": "ok" if healthy else "unavailable", "replicas": len(members), "healthy": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)


def origin_form_target(request: Request) -> str | None:
    """The request's path and query as the client sent them, or None for a target that is no path. uvicorn's
    h11 parser passes any target: ``%2F@10.0.0.9/x`` (``/@10.0.0.9/x`` decoded, so routed here) after the
    replica's ``http://HOST:PORT`` would name another host, which the router would fetch (SSRF)."""
    path = request.scope.get("raw_path") or request.url.path.encode()
    if not path.startswith(b"/"):
        return None
    query = request.scope.get("query_string", b"")
    return (path + b"?" + query if query else path).decode("latin-1")


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router's ASGI app."""
    pool = ReplicaPool()
    metrics = RouterMetrics(pool.members)
    # Health checks on httpx; the forwarding on aiohttp, whose C parser relays a streamed token at about half
    # the CPU of httpx's (bench/router_relay.py). No connection limit: the replicas' own queues (429 past
    # --max-waiting-requests) bound the load.
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=None, write=60.0, pool=None)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
    membership = Membership(
        pool, client, config.replicas, config.dns, config.health_interval_s, config.health_timeout_s
    )
    proxy = RouterProxy(config, pool, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await membership.refresh()  # start with checked replicas, not a first second of 503s
        refresher = asyncio.create_task(membership.run())
        proxy.open()
        yield
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        await proxy.aclose()
        await client.aclose()

    app = FastAPI(title="g4serve router", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.proxy, app.state.pool, app.state.membership = proxy, pool, membership

    # /health and /metrics are the router's own, unless pinned to a replica (X-G4Serve-Replica): then that
    # replica's, for an operator looking at one replica through the router.
    @app.get("/health")
    async def health(request: Request) -> Response:
        if REPLICA_HEADER in request.headers:
            return await proxy.forward(request)
        return proxy.health()

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if REPLICA_HEADER in request.headers:
            return await proxy.forward(request)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=_METHODS)
    async def forward(request: Request) -> Response:
        return await proxy.forward(request)

    return app
