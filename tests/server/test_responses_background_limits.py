"""What a background Responses stream holds while it runs.

A background response with ``stream: true`` keeps its server-sent events, so that ``GET
/v1/responses/{id}?stream=true&starting_after=N`` can resume it. Every event was kept while it ran, with no
byte limit until it was stored: on the tiny model 35 bytes an output token without logprobs (about 200 on a
model whose deltas are one token each) and 2,971 bytes a token with 20 top logprobs (8.8 MB for 2,947
tokens, five times its 1.7 MB response), for each of up to ``--max-waiting-requests`` background responses.
And a response whose events passed ``--responses-store-max-bytes`` was not stored at all once it ended: its
client's ``GET`` was a 404."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from g4serve.server.response_store import EventLog
from g4serve.server.serving_responses import _level, _replay

openai = pytest.importorskip("openai")

LONG = "Tell me a long story."  # greedy, the tiny model writes 600+ tokens without an end-of-turn
STORE_BYTES = 32 << 10  # a running stream keeps its newest 4 KiB of events (and its newest 32 events)
SHARE = STORE_BYTES // 8
NEWEST = 32


@pytest.fixture(scope="module")
def small_store(tiny_model_dir, server_factory):
    return server_factory(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "4096",
        "--responses-store-max-bytes",
        str(STORE_BYTES),
    )


def _held(serving) -> tuple[int, int]:
    """The bytes of events the running background responses hold now, and those past each one's newest 32."""
    held = beyond = 0
    for job in list(serving.background.values()):
        sizes = [len(line) for line in list(job.events or ())]
        held += sum(sizes)
        beyond += sum(sizes[:-NEWEST])
    return held, beyond


def _sse(lines) -> list[tuple[str, dict]]:
    """(the event's SSE text, its data) for each event of a raw stream."""
    events, block = [], []
    for line in lines:
        if line:
            block.append(line)
            continue
        if block:
            text = "\n".join(block) + "\n\n"
            events.append((text, json.loads(block[-1].removeprefix("data: "))))
            block = []
    return events


def _stream(client: httpx.Client, method: str, url: str, serving=None, **kwargs):
    """The events of a stream read to its end; with ``serving``, the most bytes of events held meanwhile."""
    peak, lines = 0, []
    with client.stream(method, url, **kwargs) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(response.read()), 0
        for line in response.iter_lines():
            lines.append(line)
            if serving is not None and line == "event: response.output_text.delta":
                peak = max(peak, _held(serving)[0])
    return 200, _sse(lines), peak


def _wait_stored(serving, response_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(key[1] == response_id for key in list(serving.background)):
        assert time.monotonic() < deadline, "the background response did not end"
        time.sleep(0.05)


def test_a_running_background_stream_keeps_only_its_newest_events(small_store):
    serving = small_store.app.state.serving_responses
    body = {"model": "tiny", "input": LONG, "max_output_tokens": 2000, "temperature": 0}
    with httpx.Client(base_url=small_store.base_url, timeout=120) as client:
        status, events, peak = _stream(
            client, "POST", "/v1/responses", serving, json={**body, "background": True, "stream": True}
        )
        assert status == 200
        # A client that keeps up gets every event, numbered without a gap, to the final one.
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        final = events[-1][1]
        assert final["type"] in ("response.completed", "response.incomplete")
        text = "".join(data["delta"] for _, data in events if data["type"] == "response.output_text.delta")
        assert text == final["response"]["output"][-1]["content"][0]["text"]
        total = sum(len(sse) for sse, _ in events)
        deltas = sorted(len(sse) for sse, data in events if data["type"].endswith(".delta"))
        # While it ran: its newest 1/8 of the store's bytes, and its newest 32 events, not all of them.
        assert peak <= SHARE + sum(deltas[-NEWEST:]) < total // 2, (peak, total)
        response_id = final["response"]["id"]
        _wait_stored(serving, response_id)
        # Its events passed the store's bytes: it is stored all the same (it was a 404), with its newest.
        got = client.get(f"/v1/responses/{response_id}")
        assert got.status_code == 200, got.text
        assert got.json()["output"] == final["response"]["output"]
        # The events before the kept ones are a 400 naming starting_after (the response itself is a GET).
        status, error, _ = _stream(client, "GET", f"/v1/responses/{response_id}", params={"stream": "true"})
        assert status == 400 and error["error"]["param"] == "starting_after", error
        assert "without stream" in error["error"]["message"]
        last = final["sequence_number"]
        status, tail, _ = _stream(
            client,
            "GET",
            f"/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": str(last - 1)},
        )
        assert status == 200 and [data for _, data in tail] == [final]
    small_store.wait_idle()


def test_all_running_background_streams_together_stay_within_the_store_bytes(small_store):
    """Each stream within its own share, together more than the store: the largest lose their oldest first."""
    serving = small_store.app.state.serving_responses
    client = openai.OpenAI(base_url=f"{small_store.base_url}/v1", api_key="unused", max_retries=0)
    streams = [
        client.responses.create(
            model="tiny", input=LONG, max_output_tokens=900, temperature=0, background=True, stream=True
        )
        for _ in range(12)
    ]
    for stream in streams:  # each POST's first event, then its connection goes (the responses run on)
        next(iter(stream))
        stream.close()
    peak = 0
    deadline = time.monotonic() + 120
    while serving.background:
        assert time.monotonic() < deadline, "the background responses did not end"
        peak = max(peak, _held(serving)[1])
        time.sleep(0.01)
    # Past each one's newest 32 events (kept whatever the budget), at most the store's bytes in all; each
    # within its own share, the twelve held up to 1.5 times that.
    assert peak <= STORE_BYTES, peak
    small_store.wait_idle()


def test_a_reader_that_falls_behind_the_kept_events_gets_an_error_event():
    class Job:
        done = False
        changed = asyncio.Event()

    log = EventLog()
    for i in range(10):
        log.append(f"event: response.output_text.delta\ndata: {i}\n\n")

    async def read() -> list[str]:
        replay, got = _replay(log, -1, Job()), []
        got.append(await anext(replay))
        log.trim(0, keep=4)  # the stream ran on: events 0-5 are dropped
        got += [line async for line in replay]
        return got

    first, error = asyncio.run(read())
    assert first.endswith("data: 0\n\n") and log.first == 6 and log.num_bytes == 4 * len(first)
    data = json.loads(error.split("data: ", 1)[1])
    assert data["type"] == "error" and data["param"] == "starting_after" and data["sequence_number"] == 1
    assert "before sequence number 6" in data["message"]


def test_the_budget_cuts_the_largest_logs_first():
    assert _level([100, 50, 10], 160) == 100  # fits: nothing to cut
    assert _level([100, 50, 10], 110) == 50  # the largest down to the next
    assert _level([100, 50, 10], 90) == 40  # both down to one level
    assert _level([30, 30, 30], 30) == 10
