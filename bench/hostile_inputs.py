"""What a hostile request costs the server before it is refused (issue 19's repros), on the CPU.

Times (median and minimum of ``--reps`` after one warm-up) and the peak of Python-tracked allocations
(``tracemalloc``: numpy buffers included, torch tensors not) of each refusal, beside the cost of a normal
input of the same kind:

- a 5 MB prompt (``LLMEngine.process_prompt`` on the embedded tiny model, max_model_len 4096), against a
  4 KB one that is tokenized;
- a 64 KB WAV whose header claims 1 Hz, and one claiming 2^31 Hz, against a 5 s 16 kHz WAV decoded
  (``load_audio``);
- an ffconcat playlist sent as audio;
- a JSON body nested 100,000 levels deep (``parse_json_object``), against a 1 MB flat body;
- 20,000 one-character stop strings (a 200 KB body): their refusal (``SamplingParams``), and what one token's
  stop search on the engine thread cost with them before the bound (``Request._check_stop_strings``, the
  list set past validation), against the 64 the bound lets in;
- a forced tool call's grammar, built on the event loop (``check_tools`` + ``forced_call_grammar``), from
  20,000 tools (a 1 MB body) and from one tool of 100,000 properties, against 8 tools of 8 properties;
- the model's chat template over 2,000 and 10,000 one-word messages (``Tokenizer.apply_chat_template``);
- the text a grammar forces (xgrammar's ``find_jump_forward_string``, on the engine thread) for arrays of
  1,000 / 2,000 / 4,000 copies of one ``const`` (~5,000 / 10,000 / 20,000 characters), and the refusal of a
  100,000-copy array (``StructuredSpec.json_schema``);
- one step's sampling batch (``SamplingBatch.build``) of 64 rows with 32,768-token prompts, one of them
  penalised (only that row's tokens are read), against none; and a later step of a penalised request with a
  128k-token prompt and output, its counts kept from the step before (only the new token is read), against
  counting them anew;
- the router re-cutting one 32 MB server-sent event that arrives in 64 KB reads (``relay.whole_events``: it
  took 6.8 s while each read re-searched and re-copied all that was pending), against 512 small events;
- a 64 MiB JSON body of ``{}`` values (refused by its value count before parsing; it took 40 s and 3 GB
  parsed and walked), and a whole chat answer of 16 x 1,000 tokens x 20 top logprobs encoded as FastAPI did
  (one hold of the event loop) against written 64 tokens at a time.

Writes JSON with the machine, commit and command.

    python bench/hostile_inputs.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import platform
import statistics
import struct
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import soundfile
from fastapi.encoders import jsonable_encoder

from g4serve.bench.meta import command_line, device_name, git_commit, write_result_json
from g4serve.deploy.relay import whole_events
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.layers.sampler import SamplingBatch, TokenCounts
from g4serve.outputs import Logprob
from g4serve.processing.audio import load_audio
from g4serve.sampling_params import MAX_STOP_STRINGS, SamplingParams
from g4serve.server.errors import APIError, parse_json_object
from g4serve.server.gemma4_tools import check_tools, forced_call_grammar
from g4serve.server.json_body import json_response
from g4serve.server.serving_chat import chat_logprobs
from g4serve.structured import StructuredSpec


def wav_claiming(rate: int, num_bytes: int = 64_000) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    data = bytes(num_bytes)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(riff)) + riff


def measure(call: Callable[[], object], reps: int) -> dict:
    """Median / minimum seconds and peak traced bytes of ``call``; whether it raised (a refusal)."""

    def once() -> bool:
        try:
            call()
        except (ValueError, APIError):
            return True
        return False

    refused = once()  # warm-up
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        once()
        times.append(time.perf_counter() - began)
    tracemalloc.start()
    once()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "refused": refused,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "peak_traced_bytes": peak,
    }


def _stop_search(engine: LLMEngine, stops: list[str]) -> Callable[[], object]:
    """One token's stop-string search as the engine thread runs it after every token, over 2,000 characters
    of text holding none of ``stops`` (set on the request past validation: the cost the bound prevents)."""
    params = SamplingParams(stop=["unused"], max_tokens=8)
    request = engine.make_request("stops", engine.process_prompt("Hello"), params)
    request.sampling_params.stop = stops
    request._max_stop_len = max(map(len, stops))
    request.text = "balance " * 250
    return lambda: request._check_stop_strings(len(request.text) - 1)


def _tool_cases() -> dict[str, list[dict]]:
    def tool(name: str, properties: int) -> dict:
        props = {f"p{i}": {"type": "string", "maxLength": 8} for i in range(properties)}
        return {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": props}},
        }

    return {
        "forced tools, 20000": [tool(f"f{i}", 0) for i in range(20_000)],
        "forced tool of 100000 properties": [tool("f", 100_000)],
        "forced tools, 8 x 8 properties (built)": [tool(f"f{i}", 8) for i in range(8)],
    }


def _forced_text_cases() -> dict[str, Callable[[], object]]:
    """xgrammar's forced text from the start of a const array, on a tokenizer of ASCII characters."""
    import xgrammar as xgr

    tokens = [chr(c) for c in range(32, 127)] + ["<eos>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(tokens, stop_token_ids=[len(tokens) - 1]), max_threads=1)
    cases = {}
    for count in (1_000, 2_000, 4_000):
        schema = json.dumps({"type": "array", "items": {"const": "x"}, "minItems": count})
        compiled = compiler.compile_grammar(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        cases[f"forced_text, const array of {count}"] = lambda c=compiled: xgr.GrammarMatcher(
            c
        ).find_jump_forward_string()
    huge = {"type": "array", "items": {"const": "x"}, "minItems": 100_000}
    cases["forced_text, const array of 100000 (StructuredSpec)"] = lambda: StructuredSpec.json_schema(huge)
    return cases


def _penalty_cases() -> dict[str, Callable[[], object]]:
    """One step's sampling batch: 64 rows of 32,768-token prompts, one penalised or none (counted from the
    whole lists, as the engine's first step of a request does); and a later step of one request with a
    131,072-token prompt and output, its counts kept from the step before (``TokenCounts``, the engine's),
    against counting them anew."""
    prompts = [list(range(32_768)) for _ in range(64)]
    outputs = [[1, 2, 3] for _ in range(64)]
    cases = {}
    for label, first in (("one row penalised", SamplingParams(repetition_penalty=1.2)), ("none", None)):
        params = [first or SamplingParams()] + [SamplingParams() for _ in range(63)]
        cases[f"penalties, 64 x 32768-token prompts, {label}"] = lambda p=params: SamplingBatch.build(
            p, [0] * 64, 262_144, "cpu", outputs, prompts
        )
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)]
    long_prompt, long_output = [list(range(131_072))], [list(range(131_072))]
    kept = TokenCounts(262_144, "cpu")

    def later_step():
        long_output[0].append(7)  # one new token a step
        return SamplingBatch.build(params, [0], 262_144, "cpu", long_output, long_prompt, token_counts=kept)

    cases["penalties, a 128k prompt + 128k output, counts kept"] = later_step
    cases["penalties, a 128k prompt + 128k output, counted anew"] = lambda: SamplingBatch.build(
        params, [0], 262_144, "cpu", long_output, long_prompt
    )
    return cases


def _event_stream_cases() -> dict[str, Callable[[], object]]:
    """The router re-cutting a replica's event stream at event boundaries (``relay.whole_events``, on its
    event loop): one 32 MB event arriving in 64 KB reads, against 512 whole small events."""
    chunk = b"x" * 65_536
    long_event = [b"data: "] + [chunk] * 512 + [b"\n\n"]
    small_events = [b"data: {}\n\n"] * 512

    def recut(reads: list[bytes]) -> Callable[[], int]:
        async def events() -> int:
            async def replica():
                for read in reads:
                    yield read

            return sum([len(e) async for e in whole_events(replica(), "replica", lambda exc: None)])

        return lambda: asyncio.run(events())

    return {
        "router event stream, one 32 MB event in 64 KB reads": recut(long_event),
        "router event stream, 512 small events (passed as read)": recut(small_events),
    }


def _json_cases() -> dict[str, Callable[[], object]]:
    """A 64 MiB body of ``{},`` (``parse_json_object``: refused by its value count before it is parsed),
    against 250,000 values (under the bound: parsed). And a whole chat answer of 16 choices x 1,000 tokens x
    20 top logprobs (28 MB of JSON): what FastAPI did with the returned dict (``jsonable_encoder``, then a
    dump, in one hold of the event loop) against ``json_response``, which writes the logprobs 64 tokens at a
    time (the whole body; and one slice, the event loop's longest hold)."""
    many = b'{"a":[' + b"{}," * ((64 << 20) // 3 - 4) + b"{}]}"
    parsed = b'{"a":[' + b"{}," * 249_999 + b"{}]}"
    entries = [
        {t: Logprob(-0.1 * r, r + 1, f"tok{t}") for r, t in enumerate(range(i, i + 21))} for i in range(1000)
    ]

    def answer(whole: bool) -> dict:
        choices = [{"index": i, "logprobs": chat_logprobs(entries, whole=whole)} for i in range(16)]
        return {"object": "chat.completion", "choices": choices}

    async def written() -> int:
        return sum([len(piece) async for piece in json_response(answer(True)).body_iterator])

    return {
        "json body, 64 MiB of {} values (refused before parsing)": lambda: parse_json_object(many),
        "json body, 250,000 {} values (parsed)": lambda: parse_json_object(parsed),
        "whole answer, 16 x 1000 tokens x 20 logprobs, FastAPI's encoding (before)": lambda: json.dumps(
            jsonable_encoder(answer(False))
        ),
        "whole answer, the same written in slices (after)": lambda: asyncio.run(written()),
        "whole answer, one slice of 64 tokens (after: the longest hold)": lambda: json.dumps(
            chat_logprobs(entries[:64])
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument(
        "--only", nargs="*", default=None, help="only the cases whose names hold one of these"
    )
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=32 << 20))
    normal_wav = io.BytesIO()
    t = np.arange(5 * 16_000) / 16_000
    soundfile.write(normal_wav, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16_000, format="WAV")
    deep = b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    flat = json.dumps({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    huge, small = "balance " * 655_360, "balance " * 512  # built once, outside the timing
    cases = {
        "prompt_5MB": lambda: engine.process_prompt(huge),
        "prompt_4KB (tokenized)": lambda: engine.process_prompt(small),
        "wav_1Hz_64KB": lambda: load_audio(wav_claiming(1)),
        "wav_2^31Hz": lambda: load_audio(wav_claiming(2**31, 32_000)),
        "wav_16kHz_5s (decoded)": lambda: load_audio(normal_wav.getvalue()),
        "ffconcat_as_audio": lambda: load_audio(b"ffconcat version 1.0\nfile 'x.wav'\n"),
        "json_nested_100000": lambda: parse_json_object(deep),
        "json_flat_1MB (parsed)": lambda: parse_json_object(flat),
    }
    many_stops = [chr(0x4E00 + i) for i in range(20_000)]
    cases["stops_20000 (SamplingParams)"] = lambda: SamplingParams(stop=many_stops)
    for count, stops in (
        ("20000, unbounded", many_stops),
        (f"{MAX_STOP_STRINGS}, the bound", many_stops[:64]),
    ):
        cases[f"stop search a token, {count}"] = _stop_search(engine, stops)
    for label, tools in _tool_cases().items():
        cases[label] = lambda tools=tools: forced_call_grammar(
            schemas := check_tools(tools), list(schemas), True
        )
    for count in (2_000, 10_000):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(count)]
        cases[f"chat template, {count} messages"] = lambda t=turns: engine.tokenizer.apply_chat_template(t)
    cases |= _forced_text_cases() | _penalty_cases() | _event_stream_cases() | _json_cases()
    if args.only is not None:
        cases = {name: call for name, call in cases.items() if any(part in name for part in args.only)}
    results = {name: measure(call, args.reps) for name, call in cases.items()}
    for name, r in results.items():
        verdict = "refused" if r["refused"] else "accepted"
        print(
            f"{name:26s} {verdict:8s} median {r['median_s'] * 1e3:8.2f} ms  min {r['min_s'] * 1e3:8.2f} ms  "
            f"peak {r['peak_traced_bytes'] / 2**20:8.2f} MiB"
        )
    write_result_json(
        args.out_dir,
        "hostile_inputs",
        {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "device": device_name("cpu"),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "commit": git_commit(),
            "command": command_line(),
            "reps": args.reps,
            "cases": results,
        },
    )


if __name__ == "__main__":
    main()
