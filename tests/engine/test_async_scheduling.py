"""Async scheduling (step N+1 launched before step N's samples are read back) changes nothing a client
sees: the same tokens, text, finish reasons and logprobs as synchronous steps, over media, chunked
prefill, prefix hits, preemption, aborts, stop strings, seeded sampling, penalties and grammars, with
every KV block returned."""

from __future__ import annotations

import pytest
import torch
from test_engine import assert_pools_free, make_engine, mixed_prompts  # tests/engine is on sys.path

from g4serve.engine.engine import InflightStep, LLMEngine
from g4serve.engine.inputs import PendingTokens
from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredSpec

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _run(engine: LLMEngine, requests: dict[str, tuple[object, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))
    outs = engine.run_until_finished()
    assert set(outs) == set(requests)
    return {
        rid: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].logprobs)
        for rid, o in outs.items()
    }


def _both(model_dir, requests, **kw) -> tuple[dict, dict, LLMEngine]:
    expected = _run(make_engine(model_dir, async_scheduling=False, **kw), requests)
    engine = make_engine(model_dir, async_scheduling=True, **kw)
    got = _run(engine, requests)
    assert_pools_free(engine)
    assert not engine.has_unfinished_requests()
    return expected, got, engine


def test_mixed_media_workload_matches_sync(tiny_model_dir):
    requests = {str(i): (p, GREEDY) for i, p in enumerate(mixed_prompts())}
    expected, got, engine = _both(tiny_model_dir, requests)
    assert got == expected
    assert engine.num_overlapped_steps > engine.num_steps // 2
    assert engine.kv.prefix_hit_tokens > 0


def test_sampling_options_match_sync(tiny_model_dir):
    """Stops by token, string and length; min_tokens; seeded top-k/top-p/min-p sampling; logprobs; penalties
    and a grammar (these two read the last token on the host, so their steps do not overlap)."""
    prompts = [
        "<|turn>user\nWhat is my balance?<turn|>\n<|turn>model\n",
        "savings loan branch payment " * 3,
        "The capital of France is",
        "hi",
    ]
    options = [
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["a", "e "]),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3, max_tokens=10, min_tokens=6, logprobs=3),
        SamplingParams(temperature=0, max_tokens=10, logprobs=0, stop_token_ids=[]),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
    ]
    requests = {f"{i}-{j}": (p, o) for i, p in enumerate(prompts) for j, o in enumerate(options)}
    # A token the tiny model produces early, as a stop token: some requests stop on it mid-batch.
    probe = _run(
        make_engine(tiny_model_dir, text_only=True),
        {"probe": (prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))},
    )
    stop_ids = probe["probe"][0][3:4]
    requests.update(
        {
            f"stop-{i}": (
                p,
                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=stop_ids),
            )
            for i, p in enumerate(prompts)
        }
    )
    requests["json"] = (
        prompts[0],
        SamplingParams(
            temperature=0, max_tokens=24, structured_output=StructuredSpec.regex("[a-z]{3} [0-9]{2}")
        ),
    )
    expected, got, _ = _both(tiny_model_dir, requests, text_only=True, max_num_seqs=48)
    assert got == expected
    assert any(reason == "stop" for _, _, reason, _ in got.values())
    assert got["json"][1] and got["json"][2] == "stop"


def test_preemption_matches_sync(tiny_model_dir):
    prompts = {
        str(i): (
            "savings loan branch payment statement " * (2 + i % 5),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        )
        for i in range(12)
    }
    expected, got, engine = _both(
        tiny_model_dir, prompts, kv_cache_bytes=1 << 18, text_only=True, enable_prefix_caching=False
    )
    assert got == expected
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_as_with_synchronous_steps(tiny_model_dir):
    """Blocks are registered with the prefix cache at launch: the next schedule frees sliding blocks that
    leave the window (16 tokens here), and one freed before its registration would be lost."""
    system = "you are the voice assistant of a bank. " * 2
    waves = [
        {"a": (system + "what is my balance", GREEDY)},
        {"b": (system + "send forty dollars to maria " * 3, GREEDY)},
    ]
    hits = []
    for async_scheduling in (False, True):
        engine = make_engine(
            tiny_model_dir,
            text_only=True,
            max_num_seqs=4,
            max_num_batched_tokens=48,
            async_scheduling=async_scheduling,
        )
        for wave in waves:
            _run(engine, wave)
        hits.append(engine.kv.prefix_hit_tokens)
    assert hits[1] == hits[0] > 0


def test_padded_graph_buffers_take_pending_tokens(tiny_model_dir):
    """The decode and mixed runners' packed uploads, with the previous step's samples copied in on the
    device: in order (steady decode) and re-indexed (the batch shrinks, requests join mid-decode)."""

    def run(engine):
        out = {}
        for wave in range(2):
            for i, (prompt, n) in enumerate(
                zip(["what is my balance", "send forty dollars to maria " * 3, "hi"], (3, 7, 5))
            ):
                params = SamplingParams(temperature=0, max_tokens=n + wave, ignore_eos=True)
                engine.add_request(engine.make_request(f"{wave}-{i}", engine.process_prompt(prompt), params))
                # One step before the next request joins: it joins a running batch.
                out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            out.update({rid: o.outputs[0].token_ids for rid, o in engine.run_until_finished().items()})
        return out

    expected = run(
        make_engine(
            tiny_model_dir, text_only=True, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=False
        )
    )
    engine = make_engine(
        tiny_model_dir,
        text_only=True,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        attention_backend="triton",
        async_scheduling=True,
    )
    engine.runner.use_graphs(capture=False)
    assert run(engine) == expected
    assert engine.runner.num_graph_steps == engine.num_steps
    assert engine.num_overlapped_steps > 6
    assert_pools_free(engine)


def test_next_step_launches_before_the_previous_is_read(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, text_only=True, async_scheduling=True)
    events = []
    execute, read = engine.runner.execute, InflightStep.read

    def traced_execute(batch, kv, cache, previous=None):
        events.append("launch")
        return execute(batch, kv, cache, previous)

    def traced_read(step):
        events.append("read")
        return read(step)

    monkeypatch.setattr(engine.runner, "execute", traced_execute)
    monkeypatch.setattr(InflightStep, "read", traced_read)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(engine.make_request("a", engine.process_prompt("what is my balance"), params))
    assert engine.step() == []  # launched the prefill only
    outputs = engine.step()  # launched the first decode, then read the prefill's token
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1]
    engine.run_until_finished()
    # Four tokens: prefill + three decodes; a request at max_tokens is not scheduled again.
    assert events == ["launch", "launch", "read", "launch", "read", "launch", "read", "read"]


def test_abort_while_a_step_is_in_flight(tiny_model_dir):
    engine = make_engine(tiny_model_dir, text_only=True, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for rid in "abc":
        engine.add_request(engine.make_request(rid, engine.process_prompt(f"hello {rid} " * 5), params))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None and engine.requests["b"].num_pending_outputs == 1
    tokens_before = len(engine.requests["b"].output_token_ids)
    engine.abort_request("b")
    assert engine.has_unfinished_requests()  # a and c still have the launched step to read back
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    assert "b" not in seen  # its in-flight token was dropped, nothing more was produced
    assert tokens_before < 30
    assert [len(seen[r][-1].outputs[0].token_ids) for r in "ac"] == [30, 30]
    assert_pools_free(engine)


def test_a_failed_launch_fails_its_batch_and_the_step_in_flight(tiny_model_dir, monkeypatch):
    """The in-flight step's requests can no longer be trusted, and the failed step's batch is not retried (a
    request that makes every launch fail would otherwise fail it forever): both fail with an error output;
    a request added afterwards runs once the runner works again."""
    engine = make_engine(tiny_model_dir, text_only=True, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(engine.make_request("a", engine.process_prompt("what is my balance"), params))
    engine.step()
    engine.step()
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.add_request(engine.make_request("b", engine.process_prompt("hi"), params))
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    assert all(o.finished and o.outputs[0].finish_reason == "error" and o.error for o in failed)
    assert not engine.requests and engine._inflight is None
    assert_pools_free(engine)
    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request(engine.make_request("c", engine.process_prompt("hi"), params))
    outputs = engine.run_until_finished()
    assert len(outputs["c"].outputs[0].token_ids) == 8
    assert_pools_free(engine)


@pytest.mark.parametrize("rows,src", [([0, 1, 2], [0, 1, 2]), ([1, 4], [2, 0]), ([0, 1], [1, 0])])
def test_pending_tokens_write_into(rows, src):
    ids = torch.full((6,), -1, dtype=torch.long)
    PendingTokens(rows, src, torch.tensor([10, 11, 12])).write_into(ids)
    expected = torch.full((6,), -1, dtype=torch.long)
    expected[rows] = torch.tensor([10, 11, 12])[src]
    assert torch.equal(ids, expected)
