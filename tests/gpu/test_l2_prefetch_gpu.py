"""The L2 prefetch on a GPU: it runs eagerly and from a captured graph, with ranges that need clipping, and a
decode step that prefetches computes the same tokens as one that does not."""

from __future__ import annotations

import pytest
import torch

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.kernels.l2_prefetch import l2_prefetch
from g4serve.layers import prefetch
from g4serve.layers.fused import project
from g4serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

MB = 1 << 20


@pytest.mark.parametrize("bulk", [True, False])
def test_prefetch_runs_eager_and_captured_and_changes_nothing(bulk):
    w = torch.randn(4096, 2560, device="cuda", dtype=torch.bfloat16)  # 20 MB
    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
    want = project(x, w)
    # an aligned range, an unaligned one, one running past the tensor's end
    regions = [(w, 0, 8 * MB), (w, 8 * MB + 3, 5 * MB), (w, 19 * MB, 4 * MB)]
    l2_prefetch(regions, bulk=bulk)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        l2_prefetch(regions, bulk=bulk)
        got = project(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("variant", ["e", "moe"])
@pytest.mark.parametrize("mode", ["bulk", "line"])
def test_decode_with_prefetch_gives_the_same_tokens(hf_checkpoint, variant, mode, monkeypatch):
    """bf16, CUDA graphs: the engine with every prefetch point on (a small budget, so windows span several
    projections) decodes bit for bit the tokens of the engine without them."""
    kw = dict(
        model=str(hf_checkpoint(variant)),
        device="cuda",
        dtype="bfloat16",
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    monkeypatch.setattr(prefetch, "MODE", "0")
    off = LLMEngine(EngineConfig(**kw))
    monkeypatch.setattr(prefetch, "MODE", mode)
    monkeypatch.setattr(prefetch, "BUDGET_BYTES", 64 << 10)
    on = LLMEngine(EngineConfig(**kw))
    assert not any(layer.l2_prefetch for layer in off.model.language_model.layers)
    assert all(layer.l2_prefetch for layer in on.model.language_model.layers[:-1])
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [
        turn.format(t) for t in ("What is my balance?", "Send 40 dollars to Maria", "list payments " * 8)
    ]
    results = []
    for engine in (off, on):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 9, 12)]
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(engine.make_request(str(i), engine.process_prompt(p), sp))
        done = engine.run_until_finished()
        results.append([done[str(i)].outputs[0].token_ids for i in range(len(prompts))])
        assert engine.runner.num_graph_steps > 0
    assert results[0] == results[1]
