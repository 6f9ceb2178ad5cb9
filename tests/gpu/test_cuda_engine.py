"""The engine on CUDA: fp32 equals the CPU reference path; bf16 stays close to fp32 on full-size shapes."""

from __future__ import annotations

import pytest
import torch

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.layers.attention import TorchAttention, contiguous_metadata
from g4serve.processing.image import rescale_pixels
from g4serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _prompts():
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    return [
        turn.format(t)
        for t in (
            "What is my balance?",
            "Send 40 dollars to Maria tomorrow please",
            "list my last five card payments " * 8,
        )
    ]


def _run(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), engine.process_prompt(p), params))
    done = engine.run_until_finished()
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def test_fp32_cuda_matches_cpu(hf_checkpoint):
    """Same checkpoint (transformers-written, E-type) on CPU and CUDA in fp32, TF32 off: logits of a
    prompt agree to rounding noise and the engine's greedy tokens are identical."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(
        model=str(hf_checkpoint("e")), dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=256
    )
    cpu = LLMEngine(EngineConfig(device="cpu", **kw))
    gpu = LLMEngine(EngineConfig(device="cuda", **kw))
    ids = cpu.process_prompt(_prompts()[2]).token_ids
    ref = _logits(cpu.model, cpu.model_config.text, ids, "cpu")
    got = _logits(gpu.model, gpu.model_config.text, ids, "cuda").cpu()
    diff = (got - ref).abs().max().item()
    print(f"fp32 CUDA vs CPU: max |logit diff| {diff:.2e} (logit std {ref.std().item():.3f})")
    assert diff < 1e-3
    assert _run(gpu, _prompts()) == _run(cpu, _prompts())


def _logits(model, cfg, ids: list[int], device) -> torch.Tensor:
    n = len(ids)
    blocks = -(-n // 16)
    cache = PagedKVCache(
        cfg,
        {"sliding_attention": blocks, "full_attention": blocks},
        16,
        model.language_model.embed_tokens.weight.dtype,
        device,
    )
    table = list(range(blocks))
    meta = contiguous_metadata(
        [0], [n], {"sliding_attention": [table], "full_attention": [table]}, 16, device, [[]]
    )
    with torch.inference_mode():
        return model.compute_logits(
            model(torch.tensor(ids, device=device), meta, TorchAttention(cfg, cache))
        ).float()


def test_e4b_bf16_close_to_fp32():
    """Full-size E4B shapes, random weights: bf16 logits against the fp32 path on the same weights."""
    from g4serve.models.gemma4.loader import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = load_model("e4b", dtype="float32", device="cuda", with_vision=False, with_audio=False, seed=0)
    cfg = ref.cfg.text
    ids = torch.randint(1000, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = _logits(ref, cfg, ids, "cuda")
    fast = ref.to(torch.bfloat16)
    fast.init_nonpersistent_buffers()
    got = _logits(fast, cfg, ids, "cuda")
    cos = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    err = (got - expected).abs().max().item()
    print(
        f"e4b bf16 vs fp32: min cosine {cos.min().item():.5f}, top-1 agreement {top1:.3f}, "
        f"max |diff| {err:.3f}, logit std {expected.std().item():.3f}"
    )
    assert cos.min().item() > 0.99
    assert top1 >= 0.9


@pytest.mark.parametrize("variant", ["e", "moe"])
def test_cuda_graph_decode_matches_eager(hf_checkpoint, variant):
    """Captured decode and mixed-step graphs (padded buckets, fixed split-KV counts; for MoE the fused
    experts) against eager steps, fp32: the same greedy tokens, with batches that shrink as requests
    finish at different lengths."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(
        model=str(hf_checkpoint(variant)),
        device="cuda",
        dtype="float32",
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    eager = LLMEngine(EngineConfig(enforce_eager=True, **kw))
    graphed = LLMEngine(EngineConfig(**kw))
    assert eager.runner.decode_graphs is None and graphed.runner.decode_graphs is not None
    prompts = _prompts() + ["<|turn>user\nHi<turn|>\n<|turn>model\n"] * 2
    for lengths in ((16,) * 5, (3, 9, 16, 5, 12)):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        want = _run_each(eager, prompts, params)
        steps = graphed.runner.num_graph_steps
        assert _run_each(graphed, prompts, params) == want
        assert graphed.runner.num_graph_steps > steps


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_scheduling_matches_sync(hf_checkpoint, enforce_eager):
    """Steps launched before the previous step's samples are read back (pinned copies behind an event,
    the pending input token copied in on the device, alternating staging buffers): the tokens and
    logprobs of synchronous steps, for greedy, seeded sampling and stop tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(
        model=str(hf_checkpoint("e")),
        device="cuda",
        dtype="float32",
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
    )
    prompts = _prompts() + ["<|turn>user\nHi<turn|>\n<|turn>model\n"] * 2
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 16, 5)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, logprobs=2))
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(async_scheduling=async_scheduling, **kw))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(engine.make_request(f"a{i}", engine.process_prompt(p), sp))
        done = engine.run_until_finished()
        results.append([done[f"a{i}"].outputs[0] for i in range(len(prompts))])
        assert all(pool.num_free == pool.num_blocks for pool in engine.kv.pools.values())
    sync, overlapped = results
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    # Batches differ by the discarded extra step of a stopped request: logprobs agree to rounding.
    got = [lp.logprob for entry in overlapped[-1].logprobs for lp in entry.values()]
    want = [lp.logprob for entry in sync[-1].logprobs for lp in entry.values()]
    assert got == pytest.approx(want, abs=1e-4)
    assert engine.num_overlapped_steps > 8


def _run_each(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(engine.make_request(f"g{i}", engine.process_prompt(p), sp))
    done = engine.run_until_finished()
    return [done[f"g{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_vision_graphs_match_eager_encoder(hf_checkpoint):
    """The captured vision-encoder graphs (first sight of a frame bucket, then replays with new pixels,
    batches padded to their bucket by a repeated frame) give the eager encoder's soft tokens, fp32."""
    import numpy as np

    engine = LLMEngine(
        EngineConfig(
            model=str(hf_checkpoint("e")),
            device="cuda",
            dtype="float32",
            kv_cache_bytes=64 << 20,
            max_num_batched_tokens=256,
        )
    )
    assert engine.encoder.vision_graphs is not None
    rng = np.random.default_rng(0)
    for count in (4, 3, 4, 5):  # bucket 4 captured, then replayed padded (3), as is (4), bucket 8 (5)
        frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(count)]
        item = engine.process_prompt(
            {"prompt": "<|video|>", "multi_modal_data": {"video": [frames]}}
        ).mm_items[0]
        pixels = rescale_pixels(item.data["pixel_values"].to("cuda"), video=True)
        positions = item.data["position_ids"].to("cuda")
        with torch.inference_mode():
            got = engine.encoder.encode_images(pixels, positions)
            want = engine.model.encode_images(pixels, positions)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_audio_graphs_match_eager_encoder(hf_checkpoint):
    """The captured audio-encoder graphs (warm-up buckets of one clip, then several clips of several lengths
    padded in time and number) give the eager encoder's soft tokens, fp32."""
    import numpy as np

    engine = LLMEngine(
        EngineConfig(model=str(hf_checkpoint("e")), device="cuda", dtype="float32", kv_cache_bytes=64 << 20)
    )
    assert engine.encoder.audio_graphs is not None and engine.encoder.audio_graphs._graphs  # warm-up
    rng = np.random.default_rng(0)
    for seconds in ([1.3], [0.6, 2.4, 1.7], [4.2, 0.9]):
        audio = [(0.2 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in seconds]
        items = engine.process_prompt(
            {"prompt": "<|audio|>" * len(audio), "multi_modal_data": {"audio": audio}}
        ).mm_items
        outputs: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            engine.encoder._encode_audio(items, outputs)
            for item in items:
                feats, mask = engine.encoder._audio_batch([item])
                (want,) = engine.model.encode_audio(feats, mask, [item.num_tokens])
                torch.testing.assert_close(outputs[item.content_hash], want, atol=1e-4, rtol=1e-4)


def test_vision_encoder_cuda_matches_cpu_reference(hf_checkpoint):
    """The vision tower on CUDA (fused norm + axial RoPE, fused residual norms, SDPA) against the CPU
    reference path, fp32, TF32 off: the same soft tokens to rounding noise."""
    import numpy as np

    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(
        model=str(hf_checkpoint("e")), dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=256
    )
    cpu = LLMEngine(EngineConfig(device="cpu", **kw))
    gpu = LLMEngine(EngineConfig(device="cuda", enforce_eager=True, **kw))
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(3)]
    item = cpu.process_prompt({"prompt": "<|video|>", "multi_modal_data": {"video": [frames]}}).mm_items[0]
    pixels, positions = rescale_pixels(item.data["pixel_values"], video=True), item.data["position_ids"]
    with torch.inference_mode():
        want = torch.cat(cpu.model.encode_images(pixels, positions))
        got = torch.cat(gpu.model.encode_images(pixels.cuda(), positions.cuda())).cpu()
    diff = (got - want).abs().max().item()
    print(f"vision fp32 CUDA vs CPU: max |diff| {diff:.2e} (std {want.std().item():.3f})")
    assert diff < 1e-3 * max(1.0, want.abs().max().item())


def _media_prompts(seed: int, text: str) -> list:
    """An image, a 4-frame video and a 1 s clip of random content, then a plain text prompt."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    return [
        {
            "prompt": turn.format("<|image|>Describe."),
            "multi_modal_data": {"image": Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))},
        },
        {
            "prompt": turn.format("<|video|>What happens?"),
            "multi_modal_data": {
                "video": [[rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(4)]]
            },
        },
        {
            "prompt": turn.format("<|audio|>Transcribe."),
            "multi_modal_data": {"audio": (0.2 * rng.standard_normal(16000)).astype(np.float32)},
        },
        turn.format(text),
    ]


def test_media_steps_in_graphs_match_eager(hf_checkpoint):
    """Image, video and audio prompts with the mixed graphs' soft-token buffer against eager steps, fp32,
    TF32 off: the same greedy tokens (E-type checkpoint: no bidirectional image spans)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _media_prompts(2, "Plain text after the media.")
    kw = dict(
        model=str(hf_checkpoint("e")),
        device="cuda",
        dtype="float32",
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    eager = LLMEngine(EngineConfig(enforce_eager=True, **kw))
    graphed = LLMEngine(EngineConfig(**kw))
    assert graphed.runner.mixed_graphs.media
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)
    want = _run_each(eager, prompts, params)
    steps = graphed.runner.num_graph_steps
    assert _run_each(graphed, prompts, params) == want
    assert graphed.runner.num_graph_steps > steps
    # encodes in the step are timed by events, read by later steps' polls (no synchronisation in the step)
    assert graphed.encoder.calls and all(c.seconds > 0 for c in graphed.encoder.calls)
    # Encoded ahead on the side stream (graph replays, host-made indices, no read-backs), with and without
    # async scheduling: the same tokens.
    for async_scheduling in (False, True):
        overlapped = LLMEngine(EngineConfig(overlap_encoder=True, async_scheduling=async_scheduling, **kw))
        assert overlapped.encoder.stream is not None and overlapped.encoder.vision_graphs is not None
        assert overlapped.stream.priority < overlapped.encoder.stream.priority  # the steps go first
        assert _run_each(overlapped, prompts, params) == want
        assert overlapped.encoder.num_in_flight == 0 and len(overlapped.encoder.calls) >= 2


def test_encoder_graphs_are_captured_on_streams_of_their_own(hf_checkpoint):
    """The encoders' graphs replay on the encoder's stream beside the steps' graphs (``--overlap-encoder``):
    captured on torch's one default capture stream like the steps' graphs, their GEMMs would share one
    cuBLAS workspace (``cuda_graphs._capture``); an e4b server on an H200 then stopped under 32 video QPS."""
    engine = LLMEngine(
        EngineConfig(
            model=str(hf_checkpoint("e")),
            device="cuda",
            kv_cache_bytes=64 << 20,
            max_num_batched_tokens=256,
            overlap_encoder=True,
        )
    )
    shared = torch.cuda.graph.default_capture_stream  # set by the steps' captures
    assert engine.runner.decode_graphs is not None and shared is not None
    vision, audio = engine.encoder.vision_graphs, engine.encoder.audio_graphs
    assert vision._graphs and audio._graphs  # captured at warm-up
    streams = {shared, vision.capture_stream, audio.capture_stream}
    assert len(streams) == 3 and None not in streams


def test_videos_beside_text_with_the_overlapped_encoder_finish():
    """Full-size e4b, bf16, random weights: 24 six-frame 480p videos and 16 text prompts at once with the
    encoder on its side stream, its graphs replayed beside the steps' (no media on the GPU). With the
    encoders' graphs captured on the steps' capture stream the server this mirrors hung at this load (the
    engine thread waiting for a step that never ended); here every request finishes within the bound."""
    import threading

    import numpy as np

    engine = LLMEngine(
        EngineConfig(
            model="e4b", device="cuda", overlap_encoder=True, max_num_seqs=64, kv_cache_bytes=8 << 30
        )
    )
    rng = np.random.default_rng(0)
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [
        {
            "prompt": turn.format("<|video|>What happens?"),
            "multi_modal_data": {
                "video": [[rng.integers(0, 256, (480, 854, 3), dtype=np.uint8) for _ in range(6)]]
            },
        }
        for _ in range(24)
    ] + [turn.format(f"Count to {i} slowly, one line a number. " * 20) for i in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    result: list = []
    runner = threading.Thread(target=lambda: result.append(_run_each(engine, prompts, params)), daemon=True)
    runner.start()
    runner.join(timeout=300)
    assert not runner.is_alive(), "the engine stopped: a step never finished"
    assert [len(t) for t in result[0]] == [24] * len(prompts)
    assert engine.encoder.num_in_flight == 0 and len(engine.encoder.calls) >= 1


@pytest.mark.parametrize("overlap_encoder", [False, True])
def test_media_and_penalty_steps_launch_without_a_host_sync(hf_checkpoint, overlap_encoder):
    """A step that encodes an image, a video or a clip (media prepared on the GPU), or samples with penalties
    and min_tokens, launches without waiting for the device: a host sync there stalls the host behind the
    step before, so steps stop overlapping and every decode beside media waits (under 32 video QPS a mask
    assignment and a rescale divisor copied up blocking cost the text streams' p95 ITL ~2x). Checked with
    torch's sync debug mode, which raises on a synchronising copy, ``nonzero`` or stream sync, around the
    engine's launch and encode (in the step, or started on the encoder's side stream); a first round with
    other media captures what is captured lazily."""
    engine = LLMEngine(
        EngineConfig(
            model=str(hf_checkpoint("e")),
            device="cuda",
            dtype="float32",
            media_on_gpu=True,
            overlap_encoder=overlap_encoder,
            kv_cache_bytes=64 << 20,
            max_num_batched_tokens=256,
            max_num_seqs=8,
        )
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    penalised = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, repetition_penalty=1.3)
    params = [greedy] * 3 + [penalised]
    _run_each(engine, _media_prompts(1, "Plain text 1, with penalties."), params)  # lazy captures happen

    def no_sync(fn):
        def wrapped(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return wrapped

    for name in ("_launch", "_encode", "_collect_encodes"):
        setattr(engine, name, no_sync(getattr(engine, name)))
    encodes = len(engine.encoder.calls)
    done = _run_each(engine, _media_prompts(2, "Plain text 2, with penalties."), params)
    assert all(len(tokens) >= 4 for tokens in done)
    assert len(engine.encoder.calls) > encodes  # the new media were encoded inside the checked calls
