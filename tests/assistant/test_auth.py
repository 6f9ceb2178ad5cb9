"""Customer tokens, server-issued sessions, rate limits and the origin check (auth.py), without HTTP."""

from __future__ import annotations

import base64
import json

import jwt
import pytest

from g4serve_assistant.auth import (
    AuthError,
    OriginCheck,
    RateLimiter,
    SessionRegistry,
    TokenSigner,
    api_key_matches,
    bearer_token,
    origin_of,
)

SECRET = b"s" * 32


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_token_round_trip_names_the_customer():
    signer = TokenSigner(SECRET)
    claims = signer.verify(signer.mint("cust-001"))
    assert claims.customer_id == "cust-001" and claims.token_id


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        TokenSigner(b"short")


@pytest.mark.parametrize(
    "forge",
    [
        lambda good: TokenSigner(b"x" * 32).mint("cust-001"),  # another secret
        lambda good: good[:-2] + ("AA" if not good.endswith("AA") else "BB"),  # signature bits flipped
        lambda good: jwt.encode(
            {"sub": "cust-001", "aud": "other", "iat": 0, "exp": 2**40, "jti": "j"}, SECRET
        ),
        lambda good: jwt.encode(
            {"sub": "cust-001", "aud": "g4serve-assistant", "iat": 0, "exp": 2**40}, SECRET
        ),
        lambda good: jwt.encode(
            {"sub": "cust-001", "aud": "g4serve-assistant", "iat": 0, "exp": 2**40, "jti": "j"},
            SECRET,
            algorithm="HS512",
        ),
        lambda good: "",
        lambda good: None,
        lambda good: "x" * 5000,
    ],
)
def test_forged_tokens_are_401(forge):
    signer = TokenSigner(SECRET)
    with pytest.raises(AuthError) as err:
        signer.verify(forge(signer.mint("cust-001")))
    assert err.value.status == 401 and err.value.param == "authorization"


def test_alg_none_token_is_refused():
    """The classic JWT forgery: a header saying ``alg: none`` and no signature."""

    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"sub": "cust-002", "aud": "g4serve-assistant", "iat": 0, "exp": 2**40, "jti": "j"}
    token = f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."
    with pytest.raises(AuthError):
        TokenSigner(SECRET).verify(token)


def test_token_substituted_subject_breaks_the_signature():
    signer = TokenSigner(SECRET)
    header, payload, sig = signer.mint("cust-001").split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    body["sub"] = "cust-002"
    forged = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    with pytest.raises(AuthError):
        signer.verify(f"{header}.{forged}.{sig}")


def test_token_expires():
    clock = Clock()
    signer = TokenSigner(SECRET, ttl_s=60, clock=clock)
    token = signer.mint("cust-001")
    clock.t += 59
    assert signer.verify(token).customer_id == "cust-001"
    clock.t += 2
    with pytest.raises(AuthError, match="expired"):
        signer.verify(token)


@pytest.mark.parametrize("customer", ["", "a" * 65, "cust 1", "cust/1", None])
def test_mint_refuses_bad_customer_ids(customer):
    with pytest.raises(ValueError, match="customer_id"):
        TokenSigner(SECRET).mint(customer)


def test_sessions_are_bound_to_their_customer_and_expire():
    clock = Clock()
    registry = SessionRegistry(ttl_s=100, clock=clock)
    mine = registry.create("cust-001")
    assert len(mine.session_id) >= 40  # 256 bits, URL-safe
    assert registry.get(mine.session_id, "cust-001") is mine
    for probe in [(mine.session_id, "cust-002"), ("made-up", "cust-001"), (None, "cust-001")]:
        with pytest.raises(AuthError) as err:
            registry.get(*probe)
        assert err.value.status == 403
        # One message for all of them: a probe cannot tell another customer's id from a made-up one.
        assert err.value.message == "session_id: no such session for this customer (or it expired)"
    clock.t += 101
    with pytest.raises(AuthError):
        registry.get(mine.session_id, "cust-001")


def test_sessions_per_customer_are_bounded():
    registry = SessionRegistry(max_per_customer=3)
    ids = [registry.create("cust-001").session_id for _ in range(5)]
    other = registry.create("cust-002")
    assert len(registry) == 4
    with pytest.raises(AuthError):
        registry.get(ids[0], "cust-001")
    assert registry.get(ids[-1], "cust-001") and registry.get(other.session_id, "cust-002")


def test_ended_session_is_gone_and_only_its_customer_can_end_it():
    registry = SessionRegistry()
    s = registry.create("cust-001")
    assert not registry.end(s.session_id, "cust-002")
    assert registry.end(s.session_id, "cust-001")
    with pytest.raises(AuthError):
        registry.get(s.session_id, "cust-001")


def test_rate_limiter_bursts_then_refills():
    clock = Clock(0.0)
    limiter = RateLimiter(rate_per_min=60, burst=3, clock=clock)
    assert [limiter.take("k") for _ in range(3)] == [None, None, None]
    wait = limiter.take("k")
    assert wait is not None and 0 < wait <= 1.0
    assert limiter.take("other") is None  # keys are independent
    clock.t += 1.0
    assert limiter.take("k") is None


def test_rate_limiter_charges_costs_and_carries_a_debt():
    clock = Clock(0.0)
    limiter = RateLimiter(rate_per_min=60, burst=3, clock=clock)
    assert limiter.take("k", 0.5) is None  # half a request's worth (a second of audio): 2.5 left
    assert limiter.take("k", 10.0) is None  # more than the burst passes while a token is there: -7.5 left
    assert limiter.take("k", 0.5) == pytest.approx(8.0)  # and is paid for before anything else passes
    clock.t += 8.5
    assert limiter.take("k") is None and limiter.take("k", 0.01) is not None


@pytest.mark.parametrize(
    "headers, ok",
    [
        ({}, True),  # not a browser: the token still has to be valid
        ({"origin": "http://bank.test:8080", "host": "bank.test:8080"}, True),
        ({"origin": "https://app.bank.example", "host": "bank.test:8080"}, True),  # allowed
        ({"origin": "https://evil.example", "host": "bank.test:8080"}, False),
        ({"origin": "null", "host": "bank.test:8080"}, False),
        ({"origin": "http://bank.test:8081", "host": "bank.test:8080"}, False),  # another port
        ({"sec-fetch-site": "cross-site"}, False),
        ({"sec-fetch-site": "same-site"}, False),
        ({"sec-fetch-site": "same-origin"}, True),
        ({"sec-fetch-site": "none"}, True),  # typed into the address bar
    ],
)
def test_origin_check(headers, ok):
    check = OriginCheck(["https://app.bank.example"])
    if ok:
        check.check(headers, "http")
    else:
        with pytest.raises(AuthError) as err:
            check.check(headers, "http")
        assert err.value.status == 403 and err.value.param == "origin"


def test_origin_normalization():
    assert origin_of("HTTPS://Bank.Example:443/path") == "https://bank.example"
    assert origin_of("http://[::1]:8080") == "http://[::1]:8080"
    assert origin_of("javascript:alert(1)") is None
    with pytest.raises(ValueError, match="allowed origin"):
        OriginCheck(["bank.example"])


def test_bearer_and_api_key():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert (
        bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None
    )
    assert api_key_matches("k" * 20, "k" * 20)
    assert (
        not api_key_matches("k" * 20, None)
        and not api_key_matches(None, "k")
        and not api_key_matches("a", "b")
    )
