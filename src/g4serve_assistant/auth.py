"""Who may act: customer session tokens signed by the deploying bank (HS256 JWT naming the customer),
server-issued sessions bound to one customer, the operator's API key, the browser origin check and the
per-customer / per-IP rate limits. The app (app.py) applies them; nothing here knows HTTP frameworks."""

from __future__ import annotations

import hmac
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import jwt

TOKEN_AUDIENCE = "g4serve-assistant"
TOKEN_ALGORITHM = "HS256"
MIN_SECRET_BYTES = 32
MAX_TOKEN_CHARS = 4096
MAX_TOKEN_TTL_S = 24 * 3600
_CUSTOMER_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


class AuthError(Exception):
    """A request that may not proceed: ``status`` 401 (who are you), 403 (not you / not from there) or 429."""

    def __init__(
        self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


def check_customer_id(value: object) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 64 or not set(value) <= _CUSTOMER_ID_CHARS:
        raise ValueError("customer_id: 1-64 of A-Z a-z 0-9 _ . -")
    return value


@dataclass(frozen=True)
class Claims:
    customer_id: str
    expires_at: float
    token_id: str


class TokenSigner:
    """Mints and verifies customer session tokens: HS256 JWTs with ``sub`` (the customer id), ``aud``,
    ``iat``, ``exp`` and ``jti``. The bank that authenticated its customer mints them with the shared
    secret (or asks the assistant's admin route to); the assistant only verifies."""

    def __init__(self, secret: bytes, ttl_s: float = 900.0, clock: Callable[[], float] = time.time):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"session secret: at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret
        self.ttl_s = ttl_s
        self.clock = clock

    def mint(self, customer_id: str, ttl_s: float | None = None) -> str:
        check_customer_id(customer_id)
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= MAX_TOKEN_TTL_S:
            raise ValueError(f"ttl_s: must be in (0, {MAX_TOKEN_TTL_S}]")
        now = self.clock()
        claims = {
            "sub": customer_id,
            "aud": TOKEN_AUDIENCE,
            "iat": int(now),
            "exp": int(math.ceil(now + ttl)),
            "jti": secrets.token_urlsafe(12),
        }
        return jwt.encode(claims, self._secret, algorithm=TOKEN_ALGORITHM)

    def verify(self, token: object) -> Claims:
        """The token's claims; AuthError 401 for anything else (bad signature, expired, wrong audience, an
        algorithm other than HS256 — ``alg: none`` included —, missing claims)."""
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
            raise AuthError(401, "authorization: a customer session token is required", "authorization")
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=[TOKEN_ALGORITHM],
                audience=TOKEN_AUDIENCE,
                options={"require": ["sub", "exp", "iat", "aud", "jti"], "verify_iat": False},
                leeway=0,
            )
        except jwt.ExpiredSignatureError:
            raise AuthError(401, "authorization: the session token has expired", "authorization") from None
        except jwt.PyJWTError as exc:
            raise AuthError(401, f"authorization: invalid session token ({exc})", "authorization") from None
        # PyJWT checks exp against the wall clock; ours may be a test's.
        if claims["exp"] <= self.clock():
            raise AuthError(401, "authorization: the session token has expired", "authorization")
        try:
            customer_id = check_customer_id(claims["sub"])
        except ValueError:
            raise AuthError(401, "authorization: invalid session token (sub)", "authorization") from None
        return Claims(customer_id, float(claims["exp"]), str(claims["jti"]))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def api_key_matches(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison; no expected key means no access (admin routes are off)."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class Session:
    session_id: str
    customer_id: str
    created_at: float
    expires_at: float
    client: dict = field(default_factory=dict)


class SessionRegistry:
    """Server-issued sessions: 256-bit random ids, each bound to the customer whose token created it, with
    an absolute expiry. A session id alone is worth nothing: every use also needs that customer's token."""

    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_sessions: int = 100_000,
        max_per_customer: int = 32,
        clock: Callable[[], float] = time.time,
    ):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_per_customer = max_per_customer
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, customer_id: str, client: dict | None = None) -> Session:
        now = self.clock()
        with self._lock:
            self._expire(now)
            mine = [s for s in self._sessions.values() if s.customer_id == customer_id]
            for old in mine[: max(0, len(mine) - self.max_per_customer + 1)]:  # oldest of this customer go
                del self._sessions[old.session_id]
            session = Session(
                secrets.token_urlsafe(32), customer_id, now, now + self.ttl_s, dict(client or {})
            )
            self._sessions[session.session_id] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return session

    def get(self, session_id: object, customer_id: str) -> Session:
        """The live session of this customer; one error for unknown, expired and another customer's, so a
        probe learns nothing about which ids exist."""
        with self._lock:
            session = self._sessions.get(session_id) if isinstance(session_id, str) else None
            if session is None or session.customer_id != customer_id or session.expires_at <= self.clock():
                raise AuthError(
                    403, "session_id: no such session for this customer (or it expired)", "session_id"
                )
            return session

    def end(self, session_id: str, customer_id: str) -> bool:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.customer_id != customer_id:
                return False
            del self._sessions[session_id]
            return True

    def _expire(self, now: float) -> None:
        # Sessions are created in time order, so the expired ones are at the front.
        while self._sessions:
            first = next(iter(self._sessions.values()))
            if first.expires_at > now:
                break
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


class RateLimiter:
    """Token buckets by key (``customer:…``, ``ip:…``): ``rate_per_min`` sustained, ``burst`` at once.
    A request takes one token; audio takes its seconds' worth (app.py). At most ``max_keys`` keys are kept,
    the least recently used forgotten first."""

    def __init__(
        self,
        rate_per_min: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 100_000,
    ):
        if rate_per_min <= 0 or burst < 1:
            raise ValueError("rate limits: rate_per_min > 0 and burst >= 1")
        self.rate_per_s = rate_per_min / 60.0
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str, cost: float = 1.0) -> float | None:
        """Takes ``cost`` tokens: None when allowed, else the seconds until it would be.

        A cost over one token passes whenever one token is there, and the rest becomes a debt that later
        takes wait out: a frame of audio worth 2.5 requests must not be refused forever by a burst of 2,
        and it is still paid in full."""
        now = self.clock()
        need = min(cost, 1.0)
        with self._lock:
            tokens, at = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
            if tokens < need:
                self._buckets[key] = (tokens, now)
                return (need - tokens) / self.rate_per_s
            self._buckets[key] = (tokens - cost, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return None


def origin_of(url: str) -> str | None:
    """``scheme://host[:port]`` of a URL, lower case, default ports dropped; None when it has none."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    default = {"http": 80, "https": 443}[parts.scheme]
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port and port != default else "")


class OriginCheck:
    """The browser check against cross-site requests (CSRF) and cross-site WebSockets.

    A request that carries ``Origin`` must come from the assistant's own origin or from one of
    ``allowed_origins``; ``Origin: null`` (sandboxed frames, file pages) is refused. Without ``Origin``, a
    ``Sec-Fetch-Site`` of ``cross-site`` or ``same-site`` is refused. A request with neither header is not
    from a browser (curl, the bank's servers): it passes this check and still needs its token.
    """

    def __init__(self, allowed_origins: Iterable[str] = ()):
        self.allowed: set[str] = set()
        for value in allowed_origins:
            origin = origin_of(value)
            if origin is None:
                raise ValueError(f"allowed origin {value!r}: expected scheme://host[:port]")
            self.allowed.add(origin)

    def check(self, headers: Mapping[str, str], scheme: str) -> None:
        origin = headers.get("origin")
        if origin is not None:
            own = origin_of(f"{scheme}://{headers.get('host', '')}")
            given = origin_of(origin)
            if given is None or (given != own and given not in self.allowed):
                raise AuthError(403, f"origin: requests from {origin[:200]!r} are not allowed", "origin")
            return
        site = (headers.get("sec-fetch-site") or "").lower()
        if site in ("cross-site", "same-site"):
            raise AuthError(403, f"origin: {site} requests are not allowed", "origin")
