"""The persistent decode-tail kernel compiled on CUDA: against the model's separate ops at e4b (with PLE) and
31b shapes (bf16, 1-8 rows; the default tiles, and 4 tickets a grab with 256-column norm chunks), launched
again and again on one counter buffer and replayed from a CUDA graph; and the engine with
``G4SERVE_DECODE_TAIL`` on writes the tokens it writes with it off (fp32, captured graphs)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("h,q,i,p", [(2560, 2048, 10240, 256), (5376, 8192, 21504, 0)], ids=["e4b", "31b"])
@pytest.mark.parametrize("tiles", [{}, {"grab": 4, "norm_cols": 256}], ids=["default", "grab4-norm256"])
def test_kernel_equals_the_separate_ops(m, h, q, i, p, tiles):
    from g4serve.kernels.decode_tail import (
        PerLayerInput,
        TailWeights,
        decode_tail,
        decode_tail_config,
        decode_tail_reference,
        new_counters,
    )

    gen = torch.Generator(device="cuda").manual_seed(m)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * std).bfloat16()

    def norm():
        return 1 + randn(h, std=0.1)

    attn, residual = randn(m, q), randn(m, h)
    weights = TailWeights(
        randn(h, q, std=q**-0.5),
        norm(),
        norm(),
        randn(2 * i, h, std=h**-0.5),
        randn(h, i, std=i**-0.5),
        norm(),
    )
    ple = (
        PerLayerInput(randn(p, h, std=h**-0.5), randn(h, p, std=p**-0.5), randn(m, 4, p)[:, 1], norm())
        if p
        else None
    )
    scale, next_norm = torch.tensor([0.5], device="cuda").bfloat16(), norm()
    act = "gelu_pytorch_tanh"
    # the separate ops in bf16 (cuBLAS GEMMs, each intermediate rounded where the model rounds it)
    want = decode_tail_reference(attn, residual, weights, 1e-6, act, ple, scale, next_norm)
    counters = new_counters("cuda")
    config = decode_tail_config(m, h, q, i, p) | tiles  # tickets 4 a grab: the tasks of a grab stream as one

    def fused():
        return decode_tail(attn, residual, weights, 1e-6, act, counters, ple, scale, next_norm, config)

    first = fused()
    for got, ref in zip(first, want):  # a rounding flip of an intermediate moves a result about one bf16 step
        torch.testing.assert_close(got.float(), ref.float(), atol=4e-2, rtol=2e-2)
    for _ in range(5):  # the counters are back at zero after every launch
        again = fused()
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = fused()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], first[0]) and torch.equal(captured[1], first[1])
    assert not counters.any()


def greedy_tokens(checkpoint, **engine_kw) -> list[list[int]]:
    """Twelve greedy tokens for each of three chat prompts, from a fresh CUDA engine (graphs captured) on
    ``checkpoint``: what an engine-level A/B of a kernel switch compares."""
    from g4serve.engine.engine import EngineConfig, LLMEngine
    from g4serve.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(checkpoint),
        device="cuda",
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        **engine_kw,
    )
    engine = LLMEngine(config)
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [turn.format(t) for t in ("What is my balance?", "Send 40 dollars to Maria", "Hi")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(str(n), engine.process_prompt(prompt), params))
    done = engine.run_until_finished()
    return [done[str(n)].outputs[0].token_ids for n in range(len(prompts))]


@pytest.mark.parametrize("variant", ["e", "31b"])
def test_engine_tokens_with_the_kernel_equal_the_separate_ops(hf_checkpoint, variant, monkeypatch):
    import g4serve.layers.fused as fused

    torch.backends.cuda.matmul.allow_tf32 = False
    separate = greedy_tokens(hf_checkpoint(variant), dtype="float32")
    calls = []
    kernel = fused._decode_tail.decode_tail
    monkeypatch.setattr(fused, "DECODE_TAIL", True)
    monkeypatch.setattr(fused._decode_tail, "decode_tail", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    assert greedy_tokens(hf_checkpoint(variant), dtype="float32") == separate
    assert calls  # the decode steps' layer tails took the kernel (captured into the graphs)
