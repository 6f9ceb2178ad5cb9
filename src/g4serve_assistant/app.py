"""HTTP and WebSocket front of the voice banking assistant: customer sessions, turns (text or WAV), streamed
QnA, streaming audio with VAD end-pointing, the audit trail, admin routes, Prometheus metrics and a small
web page. Every request is checked here (origin, content type, size, rate, token, session) before the
pipeline sees it, and every attempt, refused ones included, leaves an audit row."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import secrets
import tempfile
from collections.abc import Awaitable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.middleware.cors import CORSMiddleware

from g4serve.server.body_budget import BodyBudget, BodyLimits
from g4serve.server.errors import (
    APIError,
    error_response,
    health_response,
    install_error_handlers,
    read_json_object,
    valid_text,
)
from g4serve.server.guard import BodyLimitsMiddleware
from g4serve_assistant.audio import SAMPLE_RATE, AudioError, decode_base64_wav, pcm16_bytes_to_float
from g4serve_assistant.audit import AuditRow
from g4serve_assistant.auth import (
    AuthError,
    Claims,
    OriginCheck,
    RateLimiter,
    SessionRegistry,
    TokenSigner,
    api_key_matches,
    bearer_token,
)
from g4serve_assistant.bank import BankUnavailableError, UnknownCustomerError
from g4serve_assistant.limits import MAX_REQUEST_BODY_BYTES
from g4serve_assistant.pipeline import Assistant, Caller, StageClock, TurnResult
from g4serve_assistant.qna import answer_events
from g4serve_assistant.state import CustomerSessions, SessionBusyError

log = logging.getLogger("g4serve_assistant")
T = TypeVar("T")

MAX_SESSION_ID_CHARS = 128
MAX_ACTION_ID_CHARS = 64
MAX_TEXT_CHARS = 1000
MAX_QNA_TOKENS = 256
MAX_IMPORT_BYTES = 16 << 20
WS_AUTH_TIMEOUT_S = 10.0
# One WebSocket binary frame: the page sends 0.1 s. A larger frame is refused before it is decoded: one of
# 90 s was transcribed whole, ~12 s of the audio thread that every customer's speech waits for.
MAX_WS_FRAME_S = 5.0
MAX_WS_FRAME_BYTES = int(MAX_WS_FRAME_S * SAMPLE_RATE) * 2  # PCM16: two bytes a sample
# What a WebSocket's messages read ahead during a turn (to see the client leave) may hold; past it the socket
# waits for the turn, as it did before.
WS_READ_AHEAD_MESSAGES = 64
WS_READ_AHEAD_BYTES = 1 << 20
_TURN_FIELDS = {"session_id", "text", "audio", "action_id"}
_QNA_FIELDS = {"question", "session_id", "max_tokens"}
_TOKEN_FIELDS = {"customer_id", "ttl_s"}
_JSON_TYPES = ("application/json",)


@dataclass
class AccessSettings:
    """How the app decides who may do what (see docs/assistant.md, "Threat model").

    ``signer`` verifies the customer session tokens the bank mints with the shared secret.
    ``admin_api_key`` guards /v1/assistant/admin/* (and /metrics unless ``metrics_public``); None turns
    the admin routes off. ``allowed_origins``: browser origins besides the app's own that may call it;
    ``cors_origins``: those that also get CORS headers (cross-origin pages of the bank). ``test_login``
    serves /test-login, which mints a token for any customer: for demos and browser tests only.
    ``audio_s_per_request``: seconds of audio (streamed or uploaded) that cost one request of the customer's
    rate, besides the turn's own: at 2 s and 60 a minute a customer streams at most twice real time.
    """

    signer: TokenSigner
    admin_api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    customer_rate_per_min: float = 60.0
    customer_burst: int = 20
    audio_s_per_request: float = 2.0
    ip_rate_per_min: float = 300.0
    ip_burst: int = 60
    session_ttl_s: float = 3600.0
    metrics_public: bool = False
    test_login: bool = False
    body_limits: BodyLimits = field(default_factory=lambda: BodyLimits(MAX_REQUEST_BODY_BYTES))
    sessions: CustomerSessions | None = field(default=None, repr=False)

    @classmethod
    def ephemeral(cls, **kwargs: Any) -> AccessSettings:
        """Settings with a random secret of this process (tokens die with it): tests and demos."""
        return cls(TokenSigner(secrets.token_bytes(32)), **kwargs)


def _index_html() -> str:
    return (resources.files("g4serve_assistant") / "static" / "index.html").read_text(encoding="utf-8")


def _test_login_html() -> str:
    return (resources.files("g4serve_assistant") / "static" / "test-login.html").read_text(encoding="utf-8")


def build_app(
    assistant: Assistant,
    access: AccessSettings,
    *,
    warmup: bool = True,
    owns_engine: bool = True,
) -> FastAPI:
    """The assistant's FastAPI app; the engine (if any) is shut down with it when ``owns_engine``."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if warmup:
            await assistant.warmup()
        sweeping = asyncio.create_task(assistant.sweeper.run())
        yield
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeping
        if assistant.state is None:
            # Sessions kept in memory end with this process, and no yes can reach their proposals after it. A
            # shared store's outlive it (another replica, or this one restarted, takes their next turn).
            await asyncio.to_thread(assistant.sweeper.drain)
        assistant.close()
        if owns_engine and assistant.engine is not None:
            assistant.engine.shutdown()

    app = FastAPI(title="g4serve assistant", version="0.2.0", lifespan=lifespan)
    app.state.assistant = assistant
    metrics = assistant.metrics
    gate = Gate(assistant, access)
    app.state.gate = gate

    install_error_handlers(app, lambda status: metrics.errors.labels(status=str(status)).inc(), log)
    install_assistant_errors(app)

    # Inside the guard: the refusals on a body's headers (413, 503) are audited as the guard's own are. A body
    # counts as it is read (the routes check the token first), so a client without one holds none of the
    # budget; every read ends by the deadline, /test-login's too.
    body_limits = access.body_limits
    app.state.body_budget = BodyBudget(body_limits.max_buffered_body_bytes)
    app.add_middleware(
        BodyLimitsMiddleware,
        limits=body_limits,
        where="assistant",
        budget=app.state.body_budget,
        hold_declared=False,
        on_refused=lambda status: metrics.errors.labels(status=str(status)).inc(),
    )
    install_guard(app, gate)

    if access.cors_origins:
        # Outside the guard: a preflight gets its CORS answer; the request itself is still guarded.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["authorization", "content-type"],
            allow_credentials=False,  # tokens travel in headers, never in cookies
            max_age=600,
        )

    app.include_router(pages_router(assistant, gate))
    if access.test_login:
        app.include_router(test_login_router(gate))
    app.include_router(assistant_router(assistant, gate, body_limits.max_request_body_bytes))
    app.include_router(admin_router(assistant, gate))
    return app


def pages_router(assistant: Assistant, gate: Gate) -> APIRouter:
    """The web page, health and Prometheus metrics (behind the operator key unless public)."""
    router = APIRouter()
    access, metrics = gate.access, assistant.metrics
    page = _index_html()

    @router.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    @router.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(status_code=204)  # no icon; a 404 would be a console error on every page load

    @router.get("/health")
    async def health() -> JSONResponse:
        engine = assistant.engine
        return health_response(engine, llm=engine is not None)

    @router.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if not access.metrics_public:
            gate.admin(request)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


def install_assistant_errors(app: FastAPI) -> None:
    """An ``AuthError`` is its status (401, 403, 404, 429) with the usual error body. A bank that cannot
    answer is a 503 the client may retry: whether anything moved is unknown, and the action id keeps a
    retried confirmation from executing twice."""
    metrics = app.state.assistant.metrics

    @app.exception_handler(AuthError)
    async def _refused(_request: Request, exc: AuthError) -> JSONResponse:
        metrics.errors.labels(status=str(exc.status)).inc()
        return _api(exc).response()

    @app.exception_handler(SessionBusyError)
    async def _busy(_request: Request, exc: SessionBusyError) -> JSONResponse:
        # Another turn of this session (on any replica) is still running; nothing of this one happened.
        metrics.errors.labels(status="409").inc()
        return error_response(409, f"session_id: {exc}; try again", "session_id", {"Retry-After": "1"})

    @app.exception_handler(BankUnavailableError)
    async def _bank_down(_request: Request, exc: BankUnavailableError) -> JSONResponse:
        log.warning("bank unavailable: %s", exc)
        metrics.errors.labels(status="503").inc()
        return error_response(503, "bank: unavailable, please try again", "bank", {"Retry-After": "5"})


def install_guard(app: FastAPI, gate: Gate) -> None:
    """The middleware that checks every request before routing (``Gate.check_http``) and audits every refusal
    and failure (the routes audit what they accept), the body limits' refusals among them."""

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        client = gate.client(request.headers, request.client.host if request.client else None)
        request.state.client = client
        try:
            gate.check_http(request.method, request.url.path, request.headers, request.url.scheme, client)
        except AuthError as exc:
            return gate.refuse(request, exc)
        try:
            response = await call_next(request)
        except Exception as exc:  # noqa: BLE001 - the 500 handler answers; the attempt must still be audited
            gate.audit_http(request, 500, f"internal error: {type(exc).__name__}")
            raise
        if response.status_code >= 400 and not getattr(request.state, "audited", False):
            gate.audit_http(request, response.status_code, None)
        return response


def test_login_router(gate: Gate) -> APIRouter:
    """``/test-login``: a page that mints a token for any customer of the bank, standing in for the bank's
    own login in demos and browser tests. Never turn it on in front of real customers."""
    router = APIRouter()
    login_page = _test_login_html()

    @router.get("/test-login", response_class=HTMLResponse)
    async def test_login_page() -> HTMLResponse:
        return HTMLResponse(login_page, headers=_PAGE_HEADERS)

    @router.post("/test-login")
    async def test_login(request: Request) -> JSONResponse:
        body = await read_json_object(request, 4096)
        customer_id = await gate.known_customer(body.get("customer_id"))
        token = gate.access.signer.mint(customer_id)
        gate.audit_request(request, customer_id, "auth", "test_login", {}, "token_minted")
        return JSONResponse({"token": token, "customer_id": customer_id})

    return router


# No framing, no referrer leaks, no inline script from elsewhere: the page holds a customer's token.
_PAGE_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'; default-src 'self'; "
    "script-src 'self' 'unsafe-inline' blob:; style-src 'self' 'unsafe-inline'; connect-src 'self' ws: wss:; "
    "media-src 'self' blob:",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class Gate:
    """The app's checks, shared by the HTTP routes and the WebSocket: origin, content type, rates, the
    customer token, the server-issued session, the admin key; and the audit rows of refused attempts."""

    def __init__(self, assistant: Assistant, access: AccessSettings):
        self.assistant = assistant
        self.access = access
        self.origins = OriginCheck((*access.allowed_origins, *access.cors_origins))
        # Server-issued sessions: the access settings' own, else the assistant's shared store's (any replica
        # knows any session), else this process's. Not `or`: a registry without sessions is falsy.
        state = assistant.state
        if access.sessions is not None:
            self.sessions = access.sessions
        elif state is not None:
            self.sessions = state.sessions
        else:
            self.sessions = SessionRegistry(ttl_s=access.session_ttl_s)
        self.customer_rate = RateLimiter(access.customer_rate_per_min, access.customer_burst)
        self.ip_rate = RateLimiter(access.ip_rate_per_min, access.ip_burst)

    # --- who is calling ------------------------------------------------------------------------------
    @staticmethod
    def client(headers: Any, ip: str | None) -> dict:
        """What the audit trail records of the client (bounded: these are the client's own words)."""
        return {
            "ip": ip,
            "user_agent": (headers.get("user-agent") or "")[:200],
            "origin": (headers.get("origin") or "")[:200] or None,
        }

    def check_http(self, method: str, path: str, headers: Any, scheme: str, client: dict) -> None:
        if not path.startswith(("/v1/assistant", "/test-login")):
            return
        retry = self.ip_rate.take(f"ip:{client['ip']}")
        if retry is not None:
            raise AuthError(429, "too many requests from this address", retry_after_s=retry)
        self.origins.check(headers, scheme)
        if method in ("POST", "PUT", "PATCH"):
            # JSON only: a cross-site form or text/plain POST (a "simple" request, sent without a CORS
            # preflight) is refused before it is read.
            ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
            if ctype not in _JSON_TYPES:
                raise AuthError(415, f"content-type: must be application/json, got {ctype or 'none'!r}")

    def customer(self, request: Request) -> Claims:
        """The verified token's customer, rate-limited per customer."""
        token = bearer_token(request.headers.get("authorization"))
        claims = self.access.signer.verify(token)
        request.state.customer_id = claims.customer_id
        request.state.client = {**request.state.client, "token_id": claims.token_id}
        self.rate(claims.customer_id)
        return claims

    def rate(self, customer_id: str) -> None:
        retry = self.customer_rate.take(f"customer:{customer_id}")
        if retry is not None:
            raise AuthError(429, "too many requests for this customer", retry_after_s=retry)

    def charge_audio(self, customer_id: str, audio_s: float) -> None:
        """Charges audio to the customer's rate, one request per ``audio_s_per_request`` seconds: a turn
        alone would buy 30 s of decoding per request, and a stream of utterances any amount."""
        per_request = self.access.audio_s_per_request
        retry = self.customer_rate.take(f"customer:{customer_id}", audio_s / per_request)
        if retry is not None:
            raise AuthError(
                429,
                f"audio: too much for this customer's rate ({self.access.customer_rate_per_min:g} requests a "
                f"minute; every {per_request:g} s of audio is one)",
                "audio",
                retry_after_s=retry,
            )

    def session(self, session_id: Any, claims: Claims) -> str:
        if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
            raise AuthError(400, "session_id: required, a session id from POST /v1/assistant/sessions")
        self.sessions.get(session_id, claims.customer_id)
        return session_id

    def admin(self, request: Request) -> None:
        if self.access.admin_api_key is None:
            raise AuthError(404, "admin routes are off (no admin API key configured)")
        if not api_key_matches(bearer_token(request.headers.get("authorization")), self.access.admin_api_key):
            raise AuthError(401, "authorization: the operator API key is required", "authorization")
        request.state.client = {**request.state.client, "admin": True}

    async def known_customer(self, customer_id: Any) -> str:
        if not isinstance(customer_id, str):
            raise AuthError(400, "customer_id: required, a string")
        try:
            await asyncio.to_thread(self.assistant.bank.customer_name, customer_id)
        except (UnknownCustomerError, KeyError, ValueError):
            raise AuthError(404, f"customer_id: no customer {customer_id[:64]!r}") from None
        return customer_id

    # --- audit ---------------------------------------------------------------------------------------
    def audit_request(
        self,
        request: Request,
        customer_id: str | None,
        stage: str,
        event: str,
        detail: dict,
        outcome: str,
        session_id: str | None = None,
    ) -> None:
        request.state.audited = True
        self.assistant.audit.append(
            [AuditRow(stage, event, detail, outcome=outcome)],
            customer_id=customer_id,
            session_id=session_id,
            client=request.state.client,
        )

    def audit_http(self, request: Request, status: int, message: str | None) -> None:
        """The row of an attempt that ended in an error before (or instead of) its route's own rows."""
        try:
            self.audit_request(
                request,
                getattr(request.state, "customer_id", None),
                "http",
                "rejected" if status < 500 else "failed",
                {
                    "method": request.method,
                    "path": request.url.path[:200],
                    "status": status,
                    "error": message,
                },
                "rejected" if status < 500 else "error",
                session_id=getattr(request.state, "session_id", None),
            )
        except Exception:  # noqa: BLE001 - an audit failure must not turn a 4xx into a crash; it is logged
            log.exception("could not audit a rejected request")

    def refuse(self, request: Request, exc: AuthError) -> JSONResponse:
        self.assistant.metrics.errors.labels(status=str(exc.status)).inc()
        self.audit_http(request, exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.param, _auth_headers(exc))


def _auth_headers(exc: AuthError) -> dict[str, str] | None:
    if exc.status == 429 and exc.retry_after_s is not None:
        return {"Retry-After": str(max(1, int(exc.retry_after_s + 0.999)))}
    if exc.status == 401:
        return {"WWW-Authenticate": 'Bearer realm="g4serve-assistant"'}
    return None


def _api(exc: AuthError) -> APIError:
    """The error response of a refusal raised anywhere (a route, the guard's handler): its status, message,
    field (named by ``param`` or the message's prefix) and auth headers."""
    return APIError(exc.status, exc.message, exc.param, _auth_headers(exc))


def assistant_router(  # noqa: C901 - route closures of one FastAPI router: every route's request checks count towards the router
    assistant: Assistant, gate: Gate, max_request_body_bytes: int = 8 << 20
) -> APIRouter:
    """The ``/v1/assistant`` endpoints, mountable on any FastAPI app (the OpenAI server included); the app
    that mounts them must also run ``install_guard`` (the checks before routing) and
    ``install_assistant_errors`` (refusals as error responses), as ``build_app`` does."""
    router = APIRouter()

    async def read_json(request: Request, allowed: set[str]) -> dict:
        body = await read_json_object(request, max_request_body_bytes)
        unknown = sorted(set(body) - allowed)
        if unknown:  # a typo ("txt") would otherwise read as a missing field
            raise APIError(
                400, f"{unknown[0]}: unknown field (expected {', '.join(sorted(allowed))})", param=unknown[0]
            )
        return body

    def authorize(
        request: Request, session_id: Any = None, need_session: bool = True, claims: Claims | None = None
    ) -> tuple[Claims, str]:
        """The token's customer (first: a bad body is then audited as that customer's attempt), then the
        session, which must be theirs."""
        claims = claims or gate.customer(request)
        if not need_session:
            return claims, ""
        sid = gate.session(session_id, claims)
        request.state.session_id = sid
        return claims, sid

    @router.post("/v1/assistant/sessions", status_code=201)
    async def new_session(request: Request) -> JSONResponse:
        claims, _ = authorize(request, need_session=False)
        await read_json(request, set())  # no fields; still JSON, still bounded
        await gate.known_customer(claims.customer_id)
        session = gate.sessions.create(claims.customer_id, request.state.client)
        gate.audit_request(
            request, claims.customer_id, "auth", "session_created", {}, "session_created", session.session_id
        )
        return JSONResponse(
            {
                "session_id": session.session_id,
                "customer_id": session.customer_id,
                "expires_at": round(session.expires_at, 3),
            },
            status_code=201,
        )

    @router.delete("/v1/assistant/sessions/{session_id}")
    async def end_session(request: Request, session_id: str) -> JSONResponse:
        claims, sid = authorize(request, session_id)
        # The pending transfer is cancelled first: if the bank does not answer (503), the session still
        # lives and the retried logout cancels it. Then no confirmation can name the session again.
        await assistant.end_session(Caller(claims.customer_id, sid, request.state.client))
        gate.sessions.end(sid, claims.customer_id)
        gate.audit_request(request, claims.customer_id, "auth", "session_ended", {}, "session_ended", sid)
        return JSONResponse({"session_id": sid, "ended": True})

    @router.post("/v1/assistant/turn")
    async def turn(request: Request) -> JSONResponse:
        clock = StageClock()
        claims, _ = authorize(request, need_session=False)
        body = await read_json(request, _TURN_FIELDS)
        claims, session_id = authorize(request, body.get("session_id"), claims=claims)
        caller = Caller(
            claims.customer_id, session_id, request.state.client, check_action_id(body.get("action_id"))
        )
        text, audio = body.get("text"), body.get("audio")
        if (text is None) == (audio is None):
            which = "both were given" if text is not None else "neither was given"
            raise APIError(400, f"text: give exactly one of 'text' or 'audio' ({which})", param="text")
        request.state.audited = False
        if text is not None:
            text = check_text(text, "text")
            result = await assistant.turn(caller, text=text, clock=clock)
        else:
            if not isinstance(audio, str):
                raise APIError(
                    400, f"audio: must be a base64 WAV string, got {type(audio).__name__}", param="audio"
                )
            try:
                with clock.stage("decode"):
                    samples = await assistant.in_audio_thread(decode_base64_wav, audio)
            except AudioError as exc:
                raise APIError(400, str(exc), param="audio") from None
            gate.charge_audio(claims.customer_id, samples.size / SAMPLE_RATE)
            result = await assistant.turn(caller, audio=samples, clock=clock)
        request.state.audited = True
        return JSONResponse(result.to_dict())

    @router.post("/v1/assistant/qna")
    async def qna(request: Request) -> StreamingResponse:
        claims, _ = authorize(request, need_session=False)
        body = await read_json(request, _QNA_FIELDS)
        claims, session_id = authorize(request, body.get("session_id"), claims=claims)
        question = check_text(body.get("question"), "question")
        max_tokens = body.get("max_tokens", 96)
        if (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= MAX_QNA_TOKENS
        ):
            raise APIError(
                400, f"max_tokens: must be an integer in [1, {MAX_QNA_TOKENS}]", param="max_tokens"
            )
        caller = Caller(claims.customer_id, session_id, request.state.client)
        request.state.audited = True  # the stream writes its own row when it ends
        stream = _qna_events(assistant, caller, question, max_tokens)
        return StreamingResponse(stream, media_type="text/event-stream")

    @router.get("/v1/assistant/audit")
    async def audit(request: Request, session_id: str | None = None, limit: int = 200) -> JSONResponse:
        claims, sid = authorize(request, session_id)
        if not 1 <= limit <= 10_000:
            raise APIError(400, "limit: must be in [1, 10000]", param="limit")
        entries = await asyncio.to_thread(assistant.audit.entries, claims.customer_id, sid, limit)
        return JSONResponse({"session_id": sid, "entries": entries})

    @router.websocket("/v1/assistant/ws")
    async def stream(ws: WebSocket) -> None:
        await websocket_session(ws, assistant, gate)

    return router


def admin_router(assistant: Assistant, gate: Gate) -> APIRouter:  # noqa: C901 - route closures of one router, each with its own request checks
    """Operator routes under ``/v1/assistant/admin``, each behind the admin API key."""
    router = APIRouter()

    @router.post("/v1/assistant/admin/tokens")
    async def mint(request: Request) -> JSONResponse:
        """A customer session token, for a bank that lets the assistant mint them (it must have
        authenticated the customer itself first)."""
        gate.admin(request)
        body = await read_json_object(request, 4096)
        ttl = _token_request(body)
        customer_id = await gate.known_customer(body.get("customer_id"))
        try:
            token = gate.access.signer.mint(customer_id, ttl)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        gate.audit_request(request, customer_id, "auth", "token_minted", {"ttl_s": ttl}, "token_minted")
        return JSONResponse({"token": token, "customer_id": customer_id})

    @router.post("/v1/assistant/admin/import/{kind}")
    async def import_csv(request: Request, kind: str) -> JSONResponse:
        """``{"csv": "<the file's text>", "customer_id": …}``: the CLI's imports over HTTP, for a bank store
        that supports them (the SQL bank: SQLite or PostgreSQL); the same validation, one transaction."""
        gate.admin(request)
        method = {
            "payees": "import_payees_csv",
            "customers": "import_customers_csv",
            "cards": "import_cards_csv",
        }
        if kind not in method or not hasattr(assistant.bank, method[kind]):
            raise APIError(404, f"kind: no {kind!r} import for this bank backend", param="kind")
        body = await read_json_object(request, MAX_IMPORT_BYTES)
        text, customer_id = body.get("csv"), body.get("customer_id")
        if not isinstance(text, str) or not text.strip():
            raise APIError(400, "csv: required, the CSV file's text", param="csv")
        if (kind == "payees") != isinstance(customer_id, str):
            raise APIError(400, "customer_id: required for payees (only)", param="customer_id")
        args = (customer_id,) if kind == "payees" else ()
        try:
            result = await asyncio.to_thread(
                _import_text, getattr(assistant.bank, method[kind]), text, kind, args
            )
        except ValueError as exc:
            raise APIError(400, f"csv: {exc}", param="csv") from None
        gate.audit_request(request, customer_id, "admin", f"import_{kind}", {"result": result}, "imported")
        return JSONResponse({"kind": kind, "imported": result})

    @router.get("/v1/assistant/admin/audit")
    async def audit(
        request: Request, customer_id: str | None = None, session_id: str | None = None, limit: int = 1000
    ) -> JSONResponse:
        gate.admin(request)
        if not 1 <= limit <= 100_000:
            raise APIError(400, "limit: must be in [1, 100000]", param="limit")
        entries = await asyncio.to_thread(assistant.audit.entries, customer_id, session_id, limit)
        return JSONResponse({"entries": entries})

    @router.get("/v1/assistant/admin/audit/verify")
    async def verify(request: Request) -> JSONResponse:
        gate.admin(request)
        check = await asyncio.to_thread(assistant.audit.verify)
        seq, head = assistant.audit.head()
        return JSONResponse({**check.to_dict(), "head_seq": seq, "head_hash": head})

    return router


async def websocket_session(ws: WebSocket, assistant: Assistant, gate: Gate) -> None:  # noqa: C901 - one websocket's life: handshake checks, the auth message, then the receive loop of audio frames and control messages
    """``/v1/assistant/ws``: the Origin check before accepting; then the first message must be
    ``{"type": "auth", "token", "session_id"}``; every later message is checked against that token (which
    ``auth`` may refresh) and the customer's rate limit."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in ws.scope.get("headers", [])}
    client = Gate.client(headers, ws.client.host if ws.client else None)
    scheme = "https" if ws.url.scheme == "wss" else "http"
    try:
        gate.origins.check(headers, scheme)
        retry = gate.ip_rate.take(f"ip:{client['ip']}")
        if retry is not None:
            raise AuthError(429, "too many requests from this address", retry_after_s=retry)
    except AuthError as exc:
        assistant.audit.append(
            [AuditRow("ws", "rejected", {"status": exc.status, "error": exc.message}, outcome="rejected")],
            customer_id=None,
            session_id=None,
            client=client,
        )
        await ws.close(code=1008, reason=exc.message[:120])
        return
    await ws.accept()

    async def refuse(exc: AuthError, customer_id: str | None = None, session_id: str | None = None) -> None:
        assistant.audit.append(
            [AuditRow("ws", "rejected", {"status": exc.status, "error": exc.message}, outcome="rejected")],
            customer_id=customer_id,
            session_id=session_id,
            client=client,
        )
        with contextlib.suppress(Exception):
            await ws.send_json(
                {"type": "error", "message": exc.message, "param": exc.param, "code": exc.status}
            )

    # The handshake carries no token (browsers cannot set headers on a WebSocket); the first message does.
    try:
        first = await asyncio.wait_for(ws.receive(), WS_AUTH_TIMEOUT_S)
        control = _control(first)
        if control is None or control.get("type") != "auth":
            raise AuthError(401, "authorization: the first message must be {type: auth, token, session_id}")
        token = control.get("token")
        claims = gate.access.signer.verify(token)
        client["token_id"] = claims.token_id
        session_id = gate.session(control.get("session_id"), claims)
    except (AuthError, asyncio.TimeoutError) as exc:
        if isinstance(exc, asyncio.TimeoutError):
            exc = AuthError(401, "authorization: no auth message in time")
        await refuse(exc)
        with contextlib.suppress(Exception):
            await ws.close(code=1008)
        return
    except WebSocketDisconnect:
        return
    customer_id = claims.customer_id
    await ws.send_json(
        {"type": "ready", "session_id": session_id, "sample_rate": SAMPLE_RATE, "format": "pcm_s16le"}
    )
    utterance = await asyncio.to_thread(assistant.listen, customer_id)
    action_id: str | None = None  # the pending action the customer's next "yes" confirms (set by the page)
    throttled = False  # audio frames are being refused for the rate: said once, not once per frame

    async def still_allowed() -> bool:
        try:
            if gate.access.signer.verify(token).customer_id != customer_id:
                raise AuthError(403, "authorization: the token names another customer")
            gate.sessions.get(session_id, customer_id)
        except AuthError as exc:
            await refuse(exc, customer_id, session_id)
            with contextlib.suppress(Exception):
                await ws.close(code=1008)
            return False
        return True

    async def run_turn(text: str | None = None, *, finish: bool = False) -> None:
        try:
            gate.rate(customer_id)
        except AuthError as exc:
            await refuse(exc, customer_id, session_id)
            return
        caller = Caller(customer_id, session_id, dict(client), action_id)
        try:
            # Read ahead meanwhile: a client that leaves cancels the turn (cut before its decision, the
            # engine request aborted) instead of having it run to its end for nobody.
            result = await inbox.run(_ws_turn(assistant, caller, utterance, text, finish))
        except WebSocketDisconnect:
            row = AuditRow("ws", "disconnected", {"in_turn": True, "text": text}, outcome="disconnected")
            await assistant.record_to_end(caller, [row])
            raise
        await ws.send_json({"type": "result", **result.to_dict()})

    inbox = _Inbox(ws)
    try:
        while True:
            message = await inbox.receive()
            if message["type"] == "websocket.disconnect":
                return
            if not await still_allowed():
                return
            if message.get("bytes") is not None:
                frame = message["bytes"]
                if not frame:
                    continue
                try:
                    # Charged before the size check, so an oversized frame is paid for too: a client
                    # sending them runs out of rate after the first few.
                    gate.charge_audio(customer_id, len(frame) / 2 / SAMPLE_RATE)
                    check_audio_frame(len(frame))
                except AuthError as exc:
                    utterance.reset()  # a transcript with a hole in it is worse than none
                    if not throttled:
                        await refuse(exc, customer_id, session_id)
                    throttled = exc.status == 429
                    continue
                throttled = False
                try:
                    pcm = pcm16_bytes_to_float(frame)
                except AudioError as exc:
                    await ws.send_json({"type": "error", "message": str(exc), "param": "audio"})
                    continue
                events = await assistant.in_audio_thread(utterance.feed, pcm)
                for event in events:
                    await ws.send_json(event)
                if utterance.ended:
                    await run_turn(finish=True)
                continue
            control = _control(message)
            kind = control.get("type") if control is not None else None
            if control is not None and "action_id" in control:
                try:
                    action_id = check_action_id(control.get("action_id"))
                except APIError as exc:
                    await ws.send_json({"type": "error", "param": "action_id", "message": exc.message})
                    continue
            if kind == "auth":  # a fresh token for the same customer (the old one is about to expire)
                fresh = control.get("token")
                try:
                    if gate.access.signer.verify(fresh).customer_id != customer_id:
                        raise AuthError(403, "authorization: the token names another customer")
                except AuthError as exc:
                    await refuse(exc, customer_id, session_id)
                    await ws.close(code=1008)
                    return
                token = fresh
            elif kind == "end":  # the client stopped talking (push-to-talk release, end of file)
                await run_turn(finish=True)
            elif kind == "reset":
                utterance.reset()
            elif kind == "action":
                pass  # action_id was taken above
            elif kind == "text":
                try:
                    text = check_text(control.get("text"), "text")
                except APIError as exc:
                    await ws.send_json({"type": "error", "param": "text", "message": exc.message})
                    continue
                await run_turn(text)
            else:
                await ws.send_json(
                    {
                        "type": "error",
                        "param": "type",
                        "message": "type: control messages are JSON objects with type 'auth', 'end', "
                        "'reset', 'action' or 'text'",
                    }
                )
    except WebSocketDisconnect:
        return
    finally:
        inbox.close()


async def _ws_turn(
    assistant: Assistant, caller: Caller, utterance, text: str | None, finish: bool
) -> TurnResult:
    """One WebSocket turn: the utterance so far (``finish``) or typed ``text``."""
    if finish:
        heard, clock = await assistant.in_audio_thread(utterance.finish)
        return await assistant.decide(caller, heard.text, clock, heard)
    return await assistant.turn(caller, text=text)


class _Inbox:
    """A WebSocket's messages, read ahead while a turn runs so that a client leaving mid-turn is seen at once.
    What is read ahead is handed out afterwards, in order; at most ``WS_READ_AHEAD_MESSAGES`` messages or
    ``WS_READ_AHEAD_BYTES`` of them wait (a client sending faster then waits for the turn, as before)."""

    def __init__(self, ws: WebSocket):
        self.ws = ws
        self._ahead: collections.deque[dict] = collections.deque()
        self._ahead_bytes = 0
        self._next: asyncio.Future | None = None  # a receive started during a turn and not yet done

    async def receive(self) -> dict:
        if self._ahead:
            message = self._ahead.popleft()
            self._ahead_bytes -= _message_bytes(message)
            return message
        pending, self._next = self._next, None
        return await (pending if pending is not None else self.ws.receive())

    async def run(self, work: Awaitable[T]) -> T:
        """``await work``, reading ahead meanwhile; a disconnect cancels it and, once it has stopped (a turn
        past its decision runs to its end: ``pipeline.run_to_end``), raises ``WebSocketDisconnect``."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done() and self._room():
                message = await self._read_ahead(task)
                if message is not None and message["type"] == "websocket.disconnect":
                    task.cancel()
                    await asyncio.wait({task})
                    raise WebSocketDisconnect(message.get("code", 1006))
            return await task
        finally:
            if not task.done():  # this coroutine was cancelled, or a receive failed
                task.cancel()
                await asyncio.wait({task})
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: raised above, or moot once the client left

    async def _read_ahead(self, task: asyncio.Future) -> dict | None:
        if self._next is None:
            self._next = asyncio.ensure_future(self.ws.receive())
        await asyncio.wait({task, self._next}, return_when=asyncio.FIRST_COMPLETED)
        if not self._next.done():
            return None
        received, self._next = self._next, None
        message = received.result()
        self._ahead.append(message)
        self._ahead_bytes += _message_bytes(message)
        return message

    def _room(self) -> bool:
        return len(self._ahead) < WS_READ_AHEAD_MESSAGES and self._ahead_bytes < WS_READ_AHEAD_BYTES

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None


def _message_bytes(message: dict) -> int:
    return len(message.get("bytes") or b"") + len(message.get("text") or "")


async def _qna_events(assistant: Assistant, caller: Caller, question: str, max_tokens: int):
    """The server-sent events of one QnA answer, and its one audit row when the stream ends: ``answered``,
    ``error`` (reported in-band too), or ``disconnected`` when the client left first (the stream is then
    cancelled or closed, and the engine request aborted with it)."""
    answer: list[str] = []
    done: dict[str, Any] = {}
    documents: list[dict] | None = None
    outcome = "error"
    stream = answer_events(question, assistant.knowledge, assistant.engine, max_tokens)
    try:
        async with contextlib.aclosing(stream):  # closed with this one, not whenever it is collected
            async for event in stream:
                if event["type"] == "documents":
                    documents = event["documents"]
                elif event["type"] == "delta":
                    answer.append(event["text"])
                elif event["type"] == "done":
                    done, outcome = event, "answered"
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        log.exception("qna stream failed")
        yield f"data: {json.dumps({'type': 'error', 'message': f'{type(exc).__name__}: {exc}'})}\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "disconnected" if not done else outcome
        raise
    finally:
        path = done.get("path")
        if path is None and documents is not None:  # cut short: the path answer_events was taking
            path = "gemma" if assistant.engine is not None and documents else "extractive"
        assistant.metrics.qna.labels(path=path if outcome == "answered" else outcome).inc()
        detail = {"question": question, "answer": "".join(answer), "path": path}
        await assistant.record_to_end(caller, [AuditRow("qna", "answer", detail, outcome=outcome)])
    yield "data: [DONE]\n\n"


def _import_text(importer, text: str, kind: str, args: tuple):
    """Runs a file importer on text: it is validated as a whole and written in one transaction, as from
    the CLI. Error messages name the line and column, not the temporary path."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kind}.csv"
        path.write_text(text, encoding="utf-8")
        try:
            return importer(path, *args)
        except ValueError as exc:
            raise ValueError(str(exc).replace(str(path), f"{kind}.csv")) from None


def _token_request(body: dict) -> float | None:
    unknown = sorted(set(body) - _TOKEN_FIELDS)
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown field", param=unknown[0])
    ttl = body.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
        raise APIError(400, "ttl_s: must be a number of seconds", param="ttl_s")
    return ttl


def _control(message: dict) -> dict | None:
    try:
        control = json.loads(message.get("text") or "")
    except (json.JSONDecodeError, RecursionError):
        return None
    return control if isinstance(control, dict) else None


def check_text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{name}: must be a string, got {type(value).__name__}", param=name)
    if not value.strip():
        raise APIError(400, f"{name}: must not be empty", param=name)
    if len(value) > MAX_TEXT_CHARS:
        raise APIError(400, f"{name}: at most {MAX_TEXT_CHARS} characters, got {len(value)}", param=name)
    if not valid_text(value):
        # over the WebSocket (the HTTP body parser refuses them) a lone surrogate reached the audit trail,
        # and every read of it failed as a 500
        raise APIError(400, f"{name}: holds invalid Unicode (a lone surrogate)", param=name)
    return value


def check_audio_frame(frame_bytes: int) -> None:
    """AuthError 413 for a WebSocket audio frame over ``MAX_WS_FRAME_S``: the client must chunk its audio."""
    if frame_bytes > MAX_WS_FRAME_BYTES:
        raise AuthError(
            413,
            f"audio: a frame of {frame_bytes / 2 / SAMPLE_RATE:.1f} s ({frame_bytes} bytes) is over the "
            f"{MAX_WS_FRAME_S:g} s limit ({MAX_WS_FRAME_BYTES} bytes); send PCM in chunks of about 0.1 s",
            "audio",
        )


def check_action_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ACTION_ID_CHARS:
        raise APIError(400, f"action_id: a pending action's id (at most {MAX_ACTION_ID_CHARS} characters)")
    return value


def pcm16_chunks(audio: np.ndarray, chunk_ms: int = 100) -> list[bytes]:
    """Float 16 kHz audio as the PCM16 chunks a streaming client sends (tests and the benchmark use it)."""
    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    step = 16 * chunk_ms
    return [pcm[i : i + step].tobytes() for i in range(0, pcm.size, step)]
