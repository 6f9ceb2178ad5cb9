"""schemathesis against the server's OpenAPI schema, on the tiny model, for a bounded time: no 5xx, no hang
(a per-request timeout), the server alive after each case.

The routes of /v1/chat/completions and /v1/completions read the raw body (``read_json_object``), so the
app's /openapi.json describes no request body for them. The schema fuzzed here is the app's own with those
bodies filled in from the pydantic models (``model_json_schema``), the free-form ``messages`` items
described as OpenAI messages (roles, text and media parts) so that generation reaches the chat template and
the media parsers. Positive (schema-valid) and negative (schema-violating) cases both run.
"""

from __future__ import annotations

import copy
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from fuzzlib import bounded, check_answer, fuzz_settings, size  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from g4serve.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

REQUEST_TIMEOUT_S = 60.0

_PART = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "image_url", "input_audio", "video_url", "audio_url", "image"]},
        "text": {"type": "string"},
        "image_url": {"type": "object", "properties": {"url": {"type": "string"}}},
        "input_audio": {"type": "object", "properties": {"data": {"type": "string"}}},
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}, {"type": "null"}]},
    },
}


def openapi_with_bodies(raw: dict) -> dict:
    """The app's OpenAPI document with the chat and completion request bodies described."""
    schema = copy.deepcopy(raw)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    bodies = (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest))
    for path, model in bodies:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        if "messages" in body.get("properties", {}):
            body["properties"]["messages"] = {"type": "array", "items": _MESSAGE, "minItems": 1}
        components[model.__name__] = body
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    return schema


def test_openapi_schema_lists_the_routes(fuzz_server):
    raw = httpx.get(fuzz_server.base_url + "/openapi.json", timeout=REQUEST_TIMEOUT_S).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(raw["paths"])


def test_schemathesis_no_server_errors(fuzz_server):
    raw = httpx.get(fuzz_server.base_url + "/openapi.json", timeout=REQUEST_TIMEOUT_S).json()
    schema = schemathesis.openapi.from_dict(openapi_with_bodies(raw))
    schema.config.update(base_url=fuzz_server.base_url)
    strategy = st.one_of(
        schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
        schema.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    budget_s = size("schemathesis_s")
    began = time.monotonic()
    ran = []

    @fuzz_settings("schemathesis_examples")
    @given(case=strategy)
    def run(case):
        if time.monotonic() - began > budget_s and ran:
            return  # the time budget is spent: the remaining examples are skipped
        case.body = bounded(case.body) if isinstance(case.body, dict) else case.body
        response = case.call(timeout=REQUEST_TIMEOUT_S)
        ran.append(response.status_code)
        where = f"{case.method} {case.path} body={str(case.body)[:300]!r}"
        content_type = response.headers.get("content-type") or [""]  # schemathesis: name -> list of values
        content_type = content_type[0] if isinstance(content_type, list) else content_type
        check_answer(response.status_code, content_type, response.text, where)
        health = httpx.get(fuzz_server.base_url + "/health", timeout=REQUEST_TIMEOUT_S)
        assert health.status_code == 200, f"after {where}: /health {health.status_code}"

    run()
    assert ran, "schemathesis generated no case"
