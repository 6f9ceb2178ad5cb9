"""Decode steps through ``DecodeGraphRunner``'s static, padded buffers give the same tokens as eager steps.

On CPU the runner cannot capture, but it runs exactly the padded forward a CUDA graph replays (Triton
kernels in the interpreter), so padding rows, stale rows of a shrinking batch and the packed uploads are
checked here; tests/gpu checks the captured replays.
"""

from __future__ import annotations

import pytest

from g4serve.engine.cuda_graphs import batch_sizes_up_to
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.sampling_params import SamplingParams


def _engine(model_dir, backend: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20,
                                  max_num_seqs=4, attention_backend=backend, text_only=True))


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
    engine.runner.decode_graphs = graphs = engine.decode_graph_runner(capture=False)
    assert graphs.batch_sizes == [1, 2, 4]
    assert _generate(engine) == expected
    assert engine.runner.num_graph_steps >= 6  # every decode step went through the padded buffers
    for pool in engine.kv.pools.values():
        assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("max_batch,sizes", [(1, [1]), (5, [1, 2, 4, 5]), (64, [1, 2, 4, 8, 16, 24, 32, 48, 64])])
def test_batch_sizes(max_batch, sizes):
    assert batch_sizes_up_to(max_batch) == sizes
