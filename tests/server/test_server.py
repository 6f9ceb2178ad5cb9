"""The OpenAI-compatible server on the tiny model, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time

import av
import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image

openai = pytest.importorskip("openai")
USER = [{"role": "user", "content": "What is my checking account balance?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


# ---- media -------------------------------------------------------------------------------------------
def _png_data_url(seed: int = 0, size: tuple[int, int] = (48, 64)) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _mp4_data_url(num_frames: int = 8) -> str:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(num_frames):
            frame = np.full((48, 64, 3), 20 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_base64(seconds: float = 1.0) -> str:
    t = np.arange(int(16000 * seconds)) / 16000
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


# ---- happy paths ---------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "g4-tiny"]
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "model": "tiny"}


def test_chat_completion_matches_offline_engine(server, client):
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # The same prompt through the tokenizer's chat template has exactly the reported prompt length.
    prompt = server.engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    assert resp.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt, add_special_tokens=False))
    again = client.chat.completions.create(model="g4-tiny", messages=USER, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_each_engine_request_is_admitted_once(server, client, monkeypatch):
    """The engine's admission (length, token ids, grammar compile) runs once per engine request: for a chat,
    a constrained chat and each of a completion's n choices, not a second time when the request is added."""
    pytest.importorskip("g4serve.structured")
    engine = server.engine
    admitted: list[str] = []
    make_request = engine.make_request

    def counted(request_id, *args, **kwargs):
        admitted.append(request_id)
        return make_request(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "make_request", counted)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0)
    assert len(admitted) == 1 and admitted[0].startswith("chatcmpl-")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, response_format=fmt)
    assert len(admitted) == 2
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, n=3, seed=1)
    children = admitted[2:]
    assert len(children) == 3 and len(set(children)) == 3  # one per choice, each once
    server.wait_idle()


def test_streaming_chat_equals_non_streaming(client):
    full = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(text) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streaming_n_and_logprobs(client):
    resp = client.completions.create(
        model="tiny",
        prompt=["Hello there", "Transfer fifty"],
        max_tokens=6,
        n=2,
        temperature=0.8,
        seed=7,
        logprobs=2,
    )
    assert len(resp.choices) == 4 and sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    for c in resp.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 6
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    again = client.completions.create(
        model="tiny", prompt=["Hello there", "Transfer fifty"], max_tokens=6, n=2, temperature=0.8, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: reproducible
    pieces = [
        ch.text
        for chunk in client.completions.create(
            model="tiny", prompt="Hello there", max_tokens=6, temperature=0, stream=True
        )
        for ch in chunk.choices
    ]
    greedy = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    assert "".join(pieces) == greedy.choices[0].text


def test_streamed_logprobs_cover_every_token(client):
    # The tiny model's tokens often decode to no text (unused specials, bytes held in a run); a chunk must
    # still carry their logprobs, or a streamed response loses most of them.
    for seed in range(3):
        full = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=16, temperature=0.8, seed=seed, logprobs=True
        )
        chunks = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=16, temperature=0.8, seed=seed, logprobs=True, stream=True
        )
        streamed = [
            lp.token for chunk in chunks for c in chunk.choices if c.logprobs for lp in c.logprobs.content
        ]
        assert streamed == [lp.token for lp in full.choices[0].logprobs.content]
        assert len(streamed) == full.usage.completion_tokens
        args = dict(model="tiny", prompt="Hello there", max_tokens=16, temperature=0.8, seed=seed, logprobs=1)
        full = client.completions.create(**args)
        tokens = [
            t
            for chunk in client.completions.create(**args, stream=True)
            for c in chunk.choices
            if c.logprobs
            for t in c.logprobs.tokens
        ]
        assert tokens == full.choices[0].logprobs.tokens and len(tokens) == full.usage.completion_tokens


def test_chat_logprobs_and_stop(client):
    resp = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert tok.logprob == pytest.approx(max(t.logprob for t in tok.top_logprobs), abs=1e-5)
    text = resp.choices[0].message.content
    if len(text) >= 3:  # stop on a string the model is known to produce
        stop = text[1:3]
        cut = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=8, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[: text.index(stop)]


def test_image_video_audio_inputs(server, client):
    content = [
        {"type": "image_url", "image_url": {"url": _png_data_url(1)}},
        {"type": "text", "text": "and the clip"},
        {"type": "video_url", "video_url": {"url": _mp4_data_url()}},
        {"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}},
        {"type": "text", "text": "What do you see and hear?"},
    ]
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
    )
    assert resp.usage.completion_tokens >= 1
    # Soft tokens: 1 image + 8 sampled frames + 1 s of audio make the prompt long.
    assert resp.usage.prompt_tokens > 300
    frames = {"type": "video", "video": [_png_data_url(i, (48, 64)) for i in range(3)]}
    resp = client.chat.completions.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": [frames, {"type": "text", "text": "?"}]}],
    )
    assert resp.usage.completion_tokens >= 1
    server.wait_idle()


def test_a_large_image_is_decoded_while_it_streams_in_and_answers_as_before(server):
    """A 1.6 MB data: URL takes the streaming body reader's path (decoded while the body arrives); the same
    body with its '/' escaped as '\\/' takes json.loads' and b64decode's: the same answer."""
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _png_data_url(3, (640, 640))}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    }
    plain = json.dumps(body)
    assert len(plain) > 1 << 20 and plain.count("/") > 1000
    answers = []
    for text in (plain, plain.replace("/", "\\/")):
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            content=text.encode(),
            headers={"content-type": "application/json"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        answers.append(r.json())
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    for key in ("prompt_tokens", "completion_tokens"):  # the second hits the prefix cache
        assert answers[0]["usage"][key] == answers[1]["usage"][key]
    server.wait_idle()


def test_constrained_json_schema_over_many_seeds(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("g4serve.structured")
    schema = {
        "type": "object",
        "properties": {
            "intent": {"type": "string", "enum": ["transfer", "balance", "card_block"]},
            "amount": {"type": "number"},
            "payee": {"type": "string", "maxLength": 12},
            "confirm": {"type": "boolean"},
        },
        "required": ["intent", "amount", "confirm"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "banking", "schema": schema, "strict": True}}

    async def one(c: openai.AsyncOpenAI, seed: int, thinking: bool) -> str:
        resp = await c.chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )
        assert resp.choices[0].finish_reason == "stop", resp.choices[0]
        return resp.choices[0].message.content

    async def main():
        c = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(c, seed, seed % 2 == 0) for seed in range(24)))

    for text in asyncio.run(main()):
        jsonschema.validate(json.loads(text), schema)
    # json_object bounds no string length: a random model may run out of tokens inside a string.
    # Whatever stopped on its own must be a JSON object, and some must stop.
    stopped = 0
    for seed in range(4):
        obj = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=300, seed=seed, response_format={"type": "json_object"}
        )
        if obj.choices[0].finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert stopped >= 1


# ---- bad input --------------------------------------------------------------------------------------------
def _chat(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}


BAD_CHAT = [
    ("malformed json", b'{"model": "tiny", "messages": [', 400, "body"),
    ("body not an object", b"[1, 2]", 400, "body"),
    ("messages wrong type", _chat(messages="hello"), 400, "messages"),
    ("messages empty", _chat(messages=[]), 400, "messages"),
    ("bad role", _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("temperature string", _chat(temperature="hot"), 400, "temperature"),
    ("temperature negative", _chat(temperature=-1), 400, "temperature"),
    ("top_p too big", _chat(top_p=1.5), 400, "top_p"),
    ("n string", _chat(n="2"), 400, "n"),
    ("stream not bool", _chat(stream="yes"), 400, "stream"),
    ("unknown model", _chat(model="gpt-9"), 404, "model"),
    ("max_tokens zero", _chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", _chat(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens beyond context", _chat(max_tokens=5000), 400, "max_tokens"),
    (
        "prompt beyond max-model-len",
        _chat(messages=[{"role": "user", "content": "balance " * 1500}]),
        400,
        "prompt",
    ),
    (
        "too many images",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _png_data_url(i)}} for i in range(3)
                    ],
                }
            ]
        ),
        400,
        "messages",
    ),
    (
        "undecodable image",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {
                                "url": "data:image/png;base64," + base64.b64encode(b"nope").decode()
                            },
                        }
                    ],
                }
            ]
        ),
        400,
        "image[0]",
    ),
    (
        "bad base64",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
    ),
    (
        "bad base64 in a large body",  # the streaming reader gives up on it; b64decode names the field
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + "QUJD" * 400_000 + "@"},
                        }
                    ],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
    ),
    (
        "undecodable large image",  # decoded while streaming, refused by the image decoder
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + "QUJD" * 400_000},
                        }
                    ],
                }
            ]
        ),
        400,
        "image[0]",
    ),
    (
        "remote url",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
    ),
    (
        "undecodable audio",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_audio",
                            "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"},
                        }
                    ],
                }
            ]
        ),
        400,
        "audio[0]",
    ),
    (
        "unsupported part",
        _chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
        400,
        "messages[0].content[0].type",
    ),
    ("top_logprobs too many", _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (
        "invalid json schema",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                },
            }
        ),
        400,
        "response_format",
    ),
    ("unknown response_format", _chat(response_format={"type": "yaml"}), 400, "response_format"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_input(server, name, body, status, param):
    if param == "response_format":
        pytest.importorskip("g4serve.structured")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status
    assert (
        param in error["message"]
        and error["param"] is not None
        and error["param"].startswith(param.split("[")[0])
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": []}, "prompt"),
        ({"model": "tiny", "prompt": [1, 2, 999999]}, "prompt_token_ids"),
        ({"model": "tiny", "prompt": 42}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "logprobs": 99}, "logprobs"),
    ],
)
def test_bad_completion_input(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(param)


def test_huge_body_is_rejected_and_server_keeps_serving(server, client):
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (5 << 20)}])).encode()
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    # Chunked upload without a Content-Length is cut off while reading.
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
    )
    assert r.status_code == 413
    assert (
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).usage.completion_tokens >= 1
    )
    server.wait_idle()


# ---- lifecycle -------------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server):
    body = _chat(max_tokens=400, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        data_lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):  # the role chunk, then generated text: the request is running and holds KV blocks
            next(data_lines)
        assert server.engine.requests
    server.wait_idle()


def test_disconnect_without_streaming_frees_blocks(server):
    """The request is aborted when its client goes away, not run to its 900th token (which would take
    longer than the 3 s allowed)."""
    body = json.dumps(_chat(max_tokens=900, ignore_eos=True)).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 20
        while not server.engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.requests
    server.wait_idle(timeout_s=3)


def test_metrics_after_traffic(server, client):
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "g4serve_time_to_first_token_seconds_count",
        "g4serve_inter_token_latency_seconds_bucket",
        "g4serve_e2e_request_latency_seconds_sum",
        "g4serve_request_queue_time_seconds_count",
        "g4serve_num_requests_running",
        "g4serve_num_requests_waiting",
        'g4serve_kv_cache_usage_ratio{pool="full_attention"}',
        "g4serve_prefix_cache_hit_rate",
        "g4serve_generation_tokens_per_second",
        "g4serve_request_success_total",
    ):
        assert name in text, name
    count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("g4serve_time_to_first_token_seconds_count")
    )
    assert count >= 1


def _scrape(server) -> dict[str, float]:
    from g4serve.bench.loadgen import parse_prometheus

    return parse_prometheus(httpx.get(f"{server.base_url}/metrics").text)


def _metrics_around_one_request(server, client, max_tokens: int) -> tuple[dict, dict]:
    """/metrics parsed before and after one chat request has finished."""
    before = _scrape(server)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=max_tokens)
    server.wait_idle()
    return before, _scrape(server)


def test_metrics_time_before_the_engine(server, client):
    """One request adds one observation to each pre-engine histogram; processing is part of preparing."""
    before, after = _metrics_around_one_request(server, client, 2)
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("g4serve_request_pre")}
    assert delta["g4serve_request_prepare_time_seconds_count"] == 1
    assert delta["g4serve_request_preprocess_time_seconds_count"] == 1
    preprocess = delta["g4serve_request_preprocess_time_seconds_sum"]
    prepare = delta["g4serve_request_prepare_time_seconds_sum"]
    assert 0 < preprocess <= prepare < 5


def test_metrics_time_each_stage_before_the_engine(server, client):
    """Reading, parsing, rendering and admitting a chat request each add one observation to their stage of
    ``g4serve_request_stage_time_seconds``, inside the request's prepare time; ``g4serve bench``'s split
    gives each stage's mean. A body that fails validation is timed as read too, and reaches no later stage."""
    from g4serve.bench.loadgen import SERVER_STAGES, server_stage_split

    before, after = _metrics_around_one_request(server, client, 2)
    split = server_stage_split(before, after)
    stages = [split[f"stage_{stage}_mean_s"] for stage in SERVER_STAGES]
    assert all(t > 0 for t in stages)
    assert sum(stages) + split["preprocess_mean_s"] <= split["prepare_mean_s"]
    before = after
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "tiny", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    split = server_stage_split(before, _scrape(server))
    assert set(k for k in split if k.startswith("stage_")) == {"stage_read_mean_s"}


def test_200_concurrent_streams(server):
    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"request {i}: my balance?"}],
            "max_tokens": 6,
            "stream": True,
            "seed": i,
        }
        tokens = 0
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    tokens += 1
        return tokens

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200 and all(n >= 2 for n in results)
    server.wait_idle()


def test_health_after_the_engine_died(tiny_model_dir, server_factory):
    """A dead engine: /health is a 503 whose body has the ``status`` health checkers read and the ``error``
    object OpenAI clients read, and completions fail with the same reason."""
    running = server_factory(tiny_model_dir, "--text-only")
    running.app.state.engine.shutdown()  # what a crashed engine thread leaves behind: `dead` set
    r = httpx.get(f"{running.base_url}/health")
    assert r.status_code == 503
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert r.json() == {
        "status": "unavailable",
        "model": model,
        "error": {
            "message": "engine is not running: it was shut down",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        },
    }
    with pytest.raises(openai.APIStatusError) as exc_info:
        client.chat.completions.create(model=model, messages=USER, max_tokens=2)
    assert exc_info.value.status_code == 503 and "engine" in exc_info.value.message


def test_health_while_a_step_stalls(tiny_model_dir, server_factory, monkeypatch):
    """A step that runs past G4SERVE_STEP_STALL_S (a device that stopped: the engine thread waits on a step's
    event for ever) turns /health into a 503 that names the stall, so a router takes the replica out; once
    the step ends it is a 200 again. 0 turns the check off."""
    running = server_factory(tiny_model_dir, "--text-only")
    engine = running.app.state.engine
    assert httpx.get(f"{running.base_url}/health").status_code == 200
    engine._step_started = (
        time.monotonic() - 75
    )  # what a step stuck for 75 s leaves (the engine thread idles)
    r = httpx.get(f"{running.base_url}/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert r.json()["error"]["message"].startswith("engine is stalled: its current step has run for 75 s")
    monkeypatch.setenv("G4SERVE_STEP_STALL_S", "0")
    assert httpx.get(f"{running.base_url}/health").status_code == 200
    monkeypatch.setenv("G4SERVE_STEP_STALL_S", "120")
    assert httpx.get(f"{running.base_url}/health").status_code == 200
    monkeypatch.setenv("G4SERVE_STEP_STALL_S", "60")
    assert httpx.get(f"{running.base_url}/health").status_code == 503
    engine._step_started = None  # the step ended
    assert httpx.get(f"{running.base_url}/health").status_code == 200


def test_api_key_and_text_only(tiny_model_dir, server_factory):
    running = server_factory(tiny_model_dir, "--api-key", "s3cret", "--text-only")
    r = httpx.post(f"{running.base_url}/v1/chat/completions", json=_chat(model=None))
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="s3cret", max_retries=0)
    assert good.chat.completions.create(
        model=good.models.list().data[0].id, messages=USER, max_tokens=2
    ).choices
    health = httpx.get(f"{running.base_url}/health")  # health needs no key
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # Text-only mode: media are refused with a clear error, nothing loaded for them.
    r = httpx.post(
        f"{running.base_url}/v1/chat/completions",
        headers={"authorization": "Bearer s3cret"},
        json=_chat(
            model=None,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url()}}]}
            ],
        ),
    )
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
    assert running.engine.model.vision_tower is None


def test_metrics_break_the_engine_thread_down_by_phase(server, client):
    """``g4serve_engine_thread_seconds_total{phase}`` grows with traffic in every phase a step goes through,
    and ``g4serve bench``'s split turns it into milliseconds per step."""
    from g4serve.bench.loadgen import server_stage_split
    from g4serve.engine.step_profile import PHASES

    before, after = _metrics_around_one_request(server, client, 4)
    key = 'g4serve_engine_thread_seconds_total{{phase="{}"}}'.format
    grew = {p for p in PHASES if after[key(p)] > before.get(key(p), 0.0)}
    assert {"commands", "schedule", "launch", "wait", "outputs", "publish"} <= grew, grew
    split = server_stage_split(before, after)
    assert split["engine_steps"] >= 4  # a prefill and three decodes at least
    per_step = split["engine_thread_ms_per_step"]
    assert set(per_step) == set(PHASES) and all(v >= 0 for v in per_step.values())
    cpu = split["engine_thread_cpu_ms_per_step"]
    assert set(cpu) == set(PHASES) and cpu["launch"] > 0
    assert split["server_itl_p50_s"] > 0  # the engine-side gaps of the request's three later tokens
    assert split["step_intervals"]["decode"]["steps"] >= 3 and split["step_intervals"]["decode"]["p50_s"] > 0


def test_metrics_sample_the_event_loop_lag(server):
    """``g4serve_event_loop_lag_seconds`` counts the loop's wake-ups from its own sampling task while idle."""
    first = _scrape(server)["g4serve_event_loop_lag_seconds_count"]
    time.sleep(0.2)
    after = _scrape(server)
    assert after["g4serve_event_loop_lag_seconds_count"] >= first + 10  # a sample every 5 ms
    assert after["g4serve_event_loop_lag_seconds_sum"] >= 0


def test_wait_for_finished_requests(server, client):
    """The bench scripts' gate for a run beside media: it returns once the server finished that many more
    requests, and gives up after its timeout (or at once where nothing answers)."""
    import threading

    from g4serve.bench.loadgen import finished_requests, wait_for_finished

    before = finished_requests(server.base_url)
    assert before is not None
    assert not wait_for_finished(server.base_url, 1, timeout_s=0.3)  # nothing sent
    timer = threading.Timer(
        0.2, lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    )
    timer.start()
    assert wait_for_finished(server.base_url, 1, timeout_s=30)
    timer.join()
    assert finished_requests(server.base_url) >= before + 1
    assert finished_requests("http://127.0.0.1:9") is None and not wait_for_finished(
        "http://127.0.0.1:9", 1, 5
    )


def test_metrics_count_the_media_caches(server, client):
    """An image sent twice: the processed-media cache misses, then hits (and holds its bytes); /metrics
    serves both caches' counters."""
    url = _png_data_url(77)
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    before = _scrape(server)
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=message, max_tokens=1)
    server.wait_idle()
    after = _scrape(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("g4serve_mm_processor_cache_misses_total") == 1
    assert grew("g4serve_mm_processor_cache_hits_total") == 1
    assert after["g4serve_mm_processor_cache_bytes"] > 0
    assert grew("g4serve_encoder_cache_hits_total") + grew("g4serve_encoder_cache_misses_total") >= 1
