"""Engine correctness on the tiny model (CPU, fp32): batching, preemption, sliding-window blocks,
aborts, prefix caching, batched encoders and fast prefill must never change a greedy token."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import Image

from g4serve.config import FULL, SLIDING
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.processing.image import rescale_pixels
from g4serve.reference import generate_one
from g4serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SYSTEM = (
    "<|turn>system\nYou are the voice assistant of a bank. Answer briefly and never invent balances.<turn|>\n"
)


def _image(seed: int, h: int = 64, w: int = 96) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _frames(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(n)]


def _audio(seed: int, seconds: float) -> np.ndarray:
    return (0.2 * np.random.default_rng(seed).standard_normal(int(16000 * seconds))).astype(np.float32)


def _user(text: str) -> str:
    return f"<|turn>user\n{text}<turn|>\n<|turn>model\n"


def mixed_prompts() -> list:
    """32 prompts: varied lengths, shared prefixes (a common system turn), images, video, audio."""
    prompts: list = []
    words = "balance transfer card savings loan branch payment statement interest account".split()
    for i in range(14):
        prompts.append(_user(" ".join(words[: 1 + (i * 7) % len(words)]) * (1 + i % 4)))
    for i in range(8):
        prompts.append(SYSTEM + _user(f"question number {i}: what is {words[i]}?"))
    for i in range(4):
        prompts.append(
            {"prompt": _user(f"<|image|>What is in picture {i}?"), "multi_modal_data": {"image": _image(i)}}
        )
    prompts.append(
        {
            "prompt": _user("<|image|><|image|>Compare them."),
            "multi_modal_data": {"image": [_image(10), _image(11, 120, 40)]},
        }
    )
    for i in range(2):
        prompts.append(
            {"prompt": _user("<|video|>What happens?"), "multi_modal_data": {"video": [_frames(20 + i, 6)]}}
        )
    for i in range(3):
        prompts.append(
            {
                "prompt": _user(f"<|audio|>Transcribe clip {i}."),
                "multi_modal_data": {"audio": _audio(i, 1 + i)},
            }
        )
    assert len(prompts) == 32
    return prompts


def make_engine(model_dir, **kw) -> LLMEngine:
    args = dict(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        kv_cache_bytes=16 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=32,
    )
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def run_all(engine: LLMEngine, prompts: list, params=GREEDY) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params))
    return {rid: out.outputs[0].token_ids for rid, out in engine.run_until_finished().items()}


def reference_tokens(engine: LLMEngine, prompts: list, params=GREEDY) -> dict[str, list[int]]:
    return {
        str(i): generate_one(
            engine.model, engine.make_request(f"ref{i}", engine.process_prompt(p), params)
        ).output_token_ids
        for i, p in enumerate(prompts)
    }


def assert_pools_free(engine: LLMEngine) -> None:
    for name, pool in engine.kv.pools.items():
        assert pool.num_free == pool.num_blocks, f"{name} pool leaked {pool.num_used} blocks"
        assert all(c == 0 for c in pool.ref_count)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(engine):
    return reference_tokens(engine, mixed_prompts())


def test_mixed_batch_matches_each_alone(engine, reference):
    results = run_all(engine, mixed_prompts())
    assert results == reference
    assert_pools_free(engine)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0  # the shared system turn was reused


def test_the_prefill_cap_beside_decodes_keeps_outputs_exact(tiny_model_dir, reference, tmp_path):
    engine = make_engine(tiny_model_dir, max_prefill_tokens_beside_decodes=24)
    assert run_all(engine, mixed_prompts()) == reference
    assert_pools_free(engine)
    # images attended bidirectionally (26B/31B): a span over the cap runs whole, nothing starves
    from g4serve.tiny import make_tiny

    prompts = [p for p in mixed_prompts() if not (isinstance(p, dict) and "audio" in p["multi_modal_data"])]
    capped = make_engine(
        make_tiny(tmp_path / "31b", "31b"), max_num_batched_tokens=512, max_prefill_tokens_beside_decodes=24
    )
    assert capped.scheduler.bidirectional_spans
    assert run_all(capped, prompts) == reference_tokens(capped, prompts)
    assert_pools_free(capped)


def test_preemption_keeps_outputs_exact(tiny_model_dir, reference):
    # Room for only a few sequences at once: the scheduler must preempt and recompute.
    engine = make_engine(tiny_model_dir, kv_cache_bytes=1 << 20, enable_prefix_caching=False)
    prompts = mixed_prompts()
    results = run_all(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert results == reference
    assert_pools_free(engine)


def test_penalties_kept_across_steps_match_counting_anew(tiny_model_dir):
    """The engine keeps penalised requests' prompt masks and output counts on the device from step to step
    (layers.sampler.TokenCounts); the reference counts them from the whole lists at every step. Outputs
    agree under preemption, beside unpenalised rows, and when a finished request's row goes to the next."""
    engine = make_engine(tiny_model_dir, kv_cache_bytes=1 << 20, enable_prefix_caching=False, text_only=True)
    penalties = [
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=1.2, presence_penalty=0.4),
        {},
        dict(repetition_penalty=0.7, frequency_penalty=-0.5),
    ]
    prompts = [_user("savings loan branch payment statement " * (3 + i % 4)) for i in range(16)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **penalties[i % 4]) for i in range(16)
    ]

    def run() -> dict[str, list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params[i]))
        return {rid: out.outputs[0].token_ids for rid, out in engine.run_until_finished().items()}

    want = {
        str(i): generate_one(
            engine.model, engine.make_request(f"r{i}", engine.process_prompt(p), params[i])
        ).output_token_ids
        for i, p in enumerate(prompts)
    }
    assert run() == want
    assert engine.scheduler.num_preemptions > 0
    counts = engine.runner.token_counts
    assert len(counts) == 0 and len(counts.free) == counts.output_counts.shape[0] - 1
    assert not counts.prompt_mask.any() and not counts.output_counts.any()  # every row zeroed for the next
    assert run() == want  # the same ids again, on rows other requests used
    assert_pools_free(engine)


def test_sliding_window_blocks_are_freed(tiny_model_dir):
    engine = make_engine(tiny_model_dir, enable_prefix_caching=False, max_num_batched_tokens=32)
    window, bs = engine.model_config.text.sliding_window, engine.config.block_size
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    engine.add_request(
        engine.make_request("long", engine.process_prompt(_user("tell me a long story " * 6)), params)
    )
    max_sliding, full_counts = 0, []
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.kv.seqs.get("long")
        if seq is None:
            continue
        max_sliding = max(max_sliding, sum(b >= 0 for b in seq.tables[SLIDING]))
        full_counts.append(sum(b >= 0 for b in seq.tables[FULL]))
    bound = -(-(window + 32) // bs) + 1
    assert max_sliding <= bound, f"sliding pool held {max_sliding} blocks (bound {bound})"
    assert full_counts[-1] > bound and full_counts == sorted(full_counts)
    assert_pools_free(engine)


def test_abort_mid_prefill_and_decode_frees_everything(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=32)
    engine.add_request(
        engine.make_request(
            "decode",
            engine.process_prompt(_user("hi")),
            # greedy, past EOS: unseeded sampling could stop it within the three steps (a CI run did)
            SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        )
    )
    long_prompt = engine.process_prompt(_user("please read my last statement again " * 12))
    assert len(long_prompt.token_ids) > 4 * 32
    engine.add_request(engine.make_request("prefill", long_prompt, GREEDY))
    for _ in range(3):
        engine.step()
    assert 0 < engine.requests["prefill"].num_computed_tokens < len(long_prompt.token_ids)  # mid-prefill
    assert engine.requests["decode"].output_token_ids  # decoding
    assert all(pool.num_used for pool in engine.kv.pools.values())
    engine.abort_request("prefill")
    engine.abort_request("decode")
    assert not engine.has_unfinished_requests()
    engine.kv.reset_prefix_cache()
    assert_pools_free(engine)


def test_prefix_cache_hits_do_not_change_outputs(tiny_model_dir):
    prompts = [SYSTEM + _user(f"what is the rate for product {i}?") for i in range(6)]
    prompts += [
        {"prompt": SYSTEM + _user("<|image|>and this?"), "multi_modal_data": {"image": _image(3)}}
    ] * 2
    cold = make_engine(tiny_model_dir, enable_prefix_caching=False)
    warm = make_engine(tiny_model_dir)
    expected = run_all(cold, prompts)
    first = run_all(warm, prompts[:1])
    assert first["0"] == expected["0"]
    results = {}
    for i, p in enumerate(prompts):  # one at a time, so later ones hit what earlier ones cached
        results.update({str(i): v for v in run_all(warm, [p]).values()})
    assert results == expected
    assert warm.kv.prefix_hit_tokens >= 5 * (len(warm.tokenizer.encode(SYSTEM)) // 16) * 16
    assert warm.stats()["prefix_cache_hit_rate"] > 0


# Batched encoding promises rounding-level agreement, not bits: BLAS picks its GEMM kernel by the row count,
# so one image's soft tokens can differ by a few ulp when other images share its call (on an AVX-512 Xeon
# 6 of 11 items differ, by up to 6.6e-7; with MKL forced to AVX2 there, all 11, by up to 2.0e-6, for values up
# to 2.6: bench/results/h100-20261125-s7/1-parity-drift). The greedy tokens are what must not change:
# test_mixed_batch_matches_each_alone runs the same prompts through the batched engine and one at a time.
ENCODER_BATCH_ATOL = 1e-5


def test_batched_encoder_matches_per_item(engine):
    items = []
    for i, prompt in enumerate(mixed_prompts()):
        if isinstance(prompt, dict):
            items.extend(engine.process_prompt(prompt).mm_items)
    model = engine.model
    alone = {}
    for item in items:
        if item.modality == "audio":
            (tokens,) = model.encode_audio(item.data["input_features"], item.data["input_features_mask"])
        else:
            pixels = rescale_pixels(item.data["pixel_values"], video=item.modality == "video")
            tokens = torch.cat(model.encode_images(pixels, item.data["position_ids"]))
        alone[item.content_hash] = tokens
    engine.encoder_cache._entries.clear()
    engine.encoder_cache.num_tokens = 0
    calls_before = len(engine.encoder.calls)
    engine.encoder.run(items)
    calls = engine.encoder.calls[calls_before:]
    # One call per tower and input shape: all image/video frames of every request together.
    videos = [it for it in items if it.modality == "video"]
    assert sum(c.num_items for c in calls) == len({it.content_hash for it in items})
    frame_call = next(
        c
        for c in calls
        if c.tower == "vision" and c.num_inputs >= sum(v.data["pixel_values"].shape[0] for v in videos)
    )
    assert frame_call.num_items == len(videos)
    assert len([c for c in calls if c.tower == "audio"]) == 1
    for digest, tokens in alone.items():
        torch.testing.assert_close(
            engine.encoder_cache.get(digest),
            tokens,
            rtol=0,
            atol=ENCODER_BATCH_ATOL,
            msg=lambda m: f"{digest}: {m}",
        )


def test_fast_prefill_is_exact(tiny_model_dir):
    prompts = mixed_prompts()[:16]
    on = make_engine(tiny_model_dir, fast_prefill=True)
    off = make_engine(tiny_model_dir, fast_prefill=False)
    assert run_all(on, prompts) == run_all(off, prompts)
    # And the logits themselves: compare last-token logits of one prompt.
    processed = on.process_prompt(prompts[3])
    logits = []
    for eng in (on, off):
        req = eng.make_request("x", processed, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
        eng.add_request(req)
        eng.run_until_finished()
        logits.append(req.logprobs[0])
    assert logits[0].keys() == logits[1].keys()
    for tid in logits[0]:
        assert abs(logits[0][tid].logprob - logits[1][tid].logprob) < 1e-5


def test_what_cannot_fit_is_refused_or_runs_alone(tiny_model_dir):
    """Nothing may wait forever: a KV cache smaller than max_model_len lowers it (long prompts get a clear
    error), and a media item larger than the whole encoder budget is encoded alone in a step."""
    small = make_engine(tiny_model_dir, kv_cache_bytes=96 << 10)
    capacity = small.kv.capacity_tokens()
    assert small.max_model_len <= capacity[FULL]
    with pytest.raises(ValueError, match="max_model_len"):
        small.make_request("long", small.process_prompt(_user("balance " * 300)), GREEDY)
    tight = make_engine(tiny_model_dir, encoder_token_budget=100)
    prompt = {"prompt": _user("<|image|>What is this?"), "multi_modal_data": {"image": _image(5)}}
    processed = tight.process_prompt(prompt)
    assert processed.mm_items[0].num_tokens > 100
    assert run_all(tight, [prompt]) == reference_tokens(tight, [prompt])
    assert_pools_free(tight)


def test_a_priority_is_honoured_only_where_the_operator_turned_it_on(engine, tiny_model_dir):
    """Under fcfs (the default) a priority would let any client jump the queue and pick who is preempted:
    it is refused, not silently ignored; under scheduling_policy="priority" it orders the queue."""
    processed = engine.process_prompt(_user("balance"))
    with pytest.raises(ValueError, match=r"^priority: -1 is not honoured"):
        engine.make_request("jump", processed, GREEDY, priority=-1)
    assert engine.make_request("plain", processed, GREEDY, priority=0).priority == 0
    ordered = make_engine(tiny_model_dir, scheduling_policy="priority", max_num_seqs=1)
    for rid, priority in (("late", 3), ("urgent", -2), ("plain", 0)):
        ordered.add_request(ordered.make_request(rid, ordered.process_prompt(_user(rid)), GREEDY, priority))
    ordered.step()
    assert [r.request_id for r in ordered.scheduler.running] == ["urgent"]
    with pytest.raises(ValueError, match=r"^priority: must be in"):
        ordered.make_request("huge", processed, GREEDY, priority=2**63)
    ordered.run_until_finished()
    assert_pools_free(ordered)


def test_the_engine_profiles_its_steps(tiny_model_dir):
    """``LLMEngine.profile``: the phases of ``step`` charged, the async loop's own (commands, publish) not
    without it, and their sum within the wall time."""
    engine = make_engine(tiny_model_dir)
    t0 = time.perf_counter()
    run_all(engine, mixed_prompts()[:6] + [mixed_prompts()[22]])
    wall = time.perf_counter() - t0
    seconds = engine.stats()["engine_thread_seconds"]
    assert all(seconds[p] > 0 for p in ("schedule", "encode", "launch", "wait", "outputs"))
    assert seconds["commands"] == seconds["publish"] == 0
    assert sum(seconds.values()) <= wall
    cpu = engine.stats()["engine_thread_cpu_seconds"]
    assert set(cpu) == set(seconds) and cpu["launch"] > 0 and cpu["commands"] == 0
    # The thread's CPU clock is coarser than the wall clock: allow a few ticks per phase.
    assert all(cpu[p] <= seconds[p] + 0.05 for p in seconds), (cpu, seconds)


def test_step_intervals_by_kind(tiny_model_dir):
    """Every step with a decode row is counted under what it carried: a prompt arriving while another decodes
    makes a prefill step, an image an encode step; the rest are decode steps."""
    engine = make_engine(tiny_model_dir)
    run_all(engine, [mixed_prompts()[0]])  # alone: a prefill step (no decode row yet), then decode steps
    counts = {k: v["buckets"][-1][1] for k, v in engine.stats()["step_intervals"].items()}
    assert counts["decode"] > 0 and counts["prefill"] == counts["encode"] == 0

    def add(rid: str, prompt) -> None:
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), GREEDY))

    add("a", mixed_prompts()[0])
    for _ in range(3):
        engine.step()
    add("b", mixed_prompts()[1])  # its prefill joins a's decodes
    add("c", {"prompt": _user("<|image|>What is this?"), "multi_modal_data": {"image": _image(5)}})
    while engine.has_unfinished_requests():
        engine.step()
    snap = engine.stats()["step_intervals"]
    after = {k: v["buckets"][-1][1] for k, v in snap.items()}
    assert after["encode"] >= 1 and after["decode"] > counts["decode"]  # c encoded beside a's decode
    assert all(v["sum"] > 0 for k, v in snap.items() if after[k])
    cumulative = [n for _, n in snap["decode"]["buckets"]]
    assert cumulative == sorted(cumulative) and snap["decode"]["buckets"][-1][0] == "+Inf"


def test_step_interval_buckets_hold_their_upper_bound(monkeypatch):
    """An interval equal to a bound counts in that bound's bucket (Prometheus' ``le``), one past every bound
    in +Inf only, and a step without decode rows is not an interval."""
    from g4serve.engine import step_profile

    clock = iter([0.0, 0.004, 0.004, 2.004, 3.0])
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: next(clock))
    intervals = step_profile.StepIntervals()
    intervals.observe("decode", True)  # the first: nothing before it
    intervals.observe("decode", True)  # 0.004 s
    intervals.observe("encode", False)  # 0 s, no decode rows: not counted
    intervals.observe("encode", True)  # 2.0 s: past every bound
    intervals.observe("prefill", True)  # 0.996 s
    snap = intervals.snapshot()
    decode = dict(snap["decode"]["buckets"])
    assert (decode["0.003"], decode["0.004"], decode["+Inf"]) == (0, 1, 1)
    encode = dict(snap["encode"]["buckets"])
    assert (encode["1"], encode["+Inf"], snap["encode"]["sum"]) == (0, 1, 2.0)
    assert dict(snap["prefill"]["buckets"])["1"] == 1


def test_the_step_profile_splits_wall_from_cpu_time():
    """Sleeping (off the CPU, as a thread waiting for the GIL is) counts in wall time only; spinning, both.
    The spin runs until the thread has used 50 ms of CPU, however long a loaded machine (CI's two cores
    shared with other processes) keeps it off the CPU meanwhile: that wait is wall time only."""
    from g4serve.engine.step_profile import StepProfile

    profile = StepProfile()
    t = profile.now()
    time.sleep(0.05)
    t = profile.add("schedule", t)
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    profile.add("launch", t)
    assert profile.seconds["schedule"] >= 0.05 and profile.cpu_seconds["schedule"] < 0.02
    assert (
        profile.cpu_seconds["launch"] >= 0.05
        and profile.seconds["launch"] >= profile.cpu_seconds["launch"] - 1e-3
    )
    profile.reset()
    assert sum(profile.seconds.values()) == sum(profile.cpu_seconds.values()) == 0
