"""Decode steps through ``DecodeGraphRunner``'s static, padded buffers give the same tokens as eager steps.

On CPU the runner cannot capture, but it runs exactly the padded forward a CUDA graph replays (Triton
kernels in the interpreter), so padding rows, stale rows of a shrinking batch and the packed uploads are
checked here; tests/gpu checks the captured replays.
"""

from __future__ import annotations

import pytest

from g4serve.engine.cuda_graphs import DEFAULT_BATCH_SIZES, sizes_up_to
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.sampling_params import SamplingParams


def _engine(model_dir, backend: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            kv_cache_bytes=16 << 20,
            max_num_seqs=4,
            attention_backend=backend,
            text_only=True,
        )
    )


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    # Different lengths: the batch shrinks 3 -> 2 -> 1, so rows padded in one step held a live sequence
    # the step before; the longest prompt crosses a KV block boundary while decoding.
    prompts = ["what is my balance", "send forty dollars to maria tomorrow " * 2, "hello " * 13]
    for i, (prompt, n) in enumerate(zip(prompts, (2, 4, 7))):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params))
    return {rid: out.outputs[0].token_ids for rid, out in engine.run_until_finished().items()}


def test_padded_decode_steps_match_eager(tiny_model_dir):
    expected = _generate(_engine(tiny_model_dir, "torch"))
    engine = _engine(tiny_model_dir, "triton")
    engine.runner.decode_graphs = graphs = engine.runner.graph_runners(capture=False)[0]
    assert graphs.batch_sizes == [1, 2, 4]
    assert _generate(engine) == expected
    assert engine.runner.num_graph_steps >= 6  # every decode step went through the padded buffers
    for pool in engine.kv.pools.values():
        assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize(
    "max_batch,sizes", [(1, [1]), (5, [1, 2, 4, 5]), (64, [1, 2, 4, 8, 16, 24, 32, 48, 64])]
)
def test_batch_sizes(max_batch, sizes):
    assert sizes_up_to(max_batch, DEFAULT_BATCH_SIZES) == sizes


def test_padded_mixed_steps_match_eager(tiny_model_dir):
    """Prefill chunks, mixed prefill+decode steps and prefix-cache hits through the mixed runner's padded
    buffers (token buckets, padding sequences, YOCO on fixed rows) give the eager tokens."""

    def run(engine):
        system = "you are the voice assistant of a bank. " * 2
        # The second wave reuses the first's system-prompt blocks (prefix hits); its long prompt is chunked
        # (48-token budget) while the short one decodes beside it.
        waves = (
            [system + "what is my balance", "hi"],
            [system + "send forty dollars to maria " * 3, "hello"],
        )
        out = {}
        for wave in waves:
            for i, prompt in enumerate(wave):
                params = SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True)
                engine.add_request(
                    engine.make_request(f"{len(out)}-{i}", engine.process_prompt(prompt), params)
                )
            out.update({rid: o.outputs[0].token_ids for rid, o in engine.run_until_finished().items()})
        return out

    def engine_with(backend, **kw):
        return LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir),
                device="cpu",
                dtype="float32",
                kv_cache_bytes=16 << 20,
                max_num_seqs=4,
                max_num_batched_tokens=48,
                attention_backend=backend,
                text_only=True,
                **kw,
            )
        )

    expected = run(engine_with("torch"))
    for fast_prefill in (True, False):
        engine = engine_with("triton", fast_prefill=fast_prefill)
        engine.runner.mixed_graphs = engine.runner.graph_runners(capture=False)[1]
        assert engine.runner.mixed_graphs.sizes == [16, 32, 48]
        assert run(engine) == expected
        assert engine.runner.num_graph_steps >= 6
        assert engine.kv.prefix_hit_tokens > 0


def test_padded_media_steps_match_eager(tiny_model_dir):
    """Steps that carry image and audio soft tokens through the mixed runner's fixed-shape row buffer and
    mask, then a text-only step after them (the marks must be cleared): the eager tokens."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    audio = (0.2 * rng.standard_normal(16000)).astype(np.float32)
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [
        {"prompt": turn.format("<|image|>What is this?"), "multi_modal_data": {"image": image}},
        {"prompt": turn.format("<|audio|>Transcribe."), "multi_modal_data": {"audio": audio}},
        turn.format("and now just text"),
    ]

    def run(engine):
        out = {}
        for i, prompt in enumerate(prompts):  # one at a time: media step, decode, then the next request
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params))
            out.update({rid: o.outputs[0].token_ids for rid, o in engine.run_until_finished().items()})
        return out

    def engine_with(backend):
        return LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir),
                device="cpu",
                dtype="float32",
                kv_cache_bytes=16 << 20,
                max_num_seqs=2,
                max_num_batched_tokens=256,
                attention_backend=backend,
            )
        )

    expected = run(engine_with("torch"))
    engine = engine_with("triton")
    engine.runner.mixed_graphs = graphs = engine.runner.graph_runners(capture=False)[1]
    assert graphs.media
    assert run(engine) == expected
    assert engine.runner.num_graph_steps >= 6
