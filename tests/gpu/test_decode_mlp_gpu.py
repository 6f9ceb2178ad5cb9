"""The persistent decode-MLP kernel compiled on CUDA: against the model's separate ops at e4b and 31b shapes
(bf16, 1-8 rows), launched again and again on one counter buffer and replayed from a CUDA graph; and the
engine with ``G4SERVE_DECODE_MLP`` on writes the tokens it writes with it off (fp32, captured graphs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("h,i", [(2560, 10240), (5376, 21504)], ids=["e4b", "31b"])
def test_kernel_equals_the_separate_ops(m, h, i):
    from g4serve.kernels.decode_mlp import decode_mlp, new_counters
    from g4serve.layers.fused import add_rms_norm, gate_up_act, linear
    from g4serve.layers.norm import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(m)
    act = "gelu_pytorch_tanh"
    gate_up = nn.Linear(h, 2 * i, bias=False, device="cuda", dtype=torch.bfloat16)
    down = nn.Linear(i, h, bias=False, device="cuda", dtype=torch.bfloat16)
    gate_up.weight.data = (torch.randn(2 * i, h, device="cuda", generator=gen) * h**-0.5).bfloat16()
    down.weight.data = (torch.randn(h, i, device="cuda", generator=gen) * i**-0.5).bfloat16()
    norm, next_norm = RMSNorm(h, 1e-6).to("cuda", torch.bfloat16), RMSNorm(h, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data.normal_(1, 0.1, generator=gen)
    x = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    scale = torch.tensor([0.5], device="cuda").bfloat16()
    want = add_rms_norm(linear(gate_up_act(x, gate_up, act), down), norm, residual, scale, next_norm)
    counters = new_counters("cuda")

    def fused():
        return decode_mlp(
            x,
            residual,
            gate_up.weight,
            down.weight,
            norm.weight,
            1e-6,
            act,
            counters,
            scale,
            next_norm.weight,
        )

    first = fused()
    for got, ref in zip(first, want):  # a rounding flip of an intermediate moves a result about one bf16 step
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
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
    assert counters.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("variant", ["e", "31b"])
def test_engine_tokens_with_the_kernel_equal_the_separate_ops(hf_checkpoint, variant, monkeypatch):
    import g4serve.layers.fused as fused
    from g4serve.engine.engine import EngineConfig, LLMEngine
    from g4serve.sampling_params import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(
        model=str(hf_checkpoint(variant)),
        device="cuda",
        dtype="float32",
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [turn.format(t) for t in ("What is my balance?", "Send 40 dollars to Maria", "Hi")]

    def tokens() -> list[list[int]]:
        engine = LLMEngine(EngineConfig(**kw))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for n, p in enumerate(prompts):
            engine.add_request(engine.make_request(str(n), engine.process_prompt(p), params))
        done = engine.run_until_finished()
        return [done[str(n)].outputs[0].token_ids for n in range(len(prompts))]

    separate = tokens()
    calls = []
    kernel = fused._decode_mlp.decode_mlp
    monkeypatch.setattr(fused, "DECODE_MLP", True)
    monkeypatch.setattr(fused._decode_mlp, "decode_mlp", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    assert tokens() == separate
    assert calls  # the decode steps' MLP blocks took the kernel (captured into the graphs)
