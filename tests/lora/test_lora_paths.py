"""The accelerator paths with adapters, run on CPU: the fused q/k/v and gate/up layout (deltas added into
column slices), the Triton kernel in place of the reference, and the padded CUDA-graph steps."""

from __future__ import annotations

import pytest
import torch

import g4serve.layers.lora as lora_layer
from g4serve import LLM, LoRARequest, SamplingParams
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.kernels.lora import add_lora
from g4serve.layers.lora import LoRABatch, LoRAWeights, projection_shapes
from g4serve.lora import load_peft_adapter
from g4serve.models.gemma4.loader import load_model
from tests.models.test_fast_layout import prefill_logits

IDS = list(range(20, 60))


def _load(path):
    return load_model(path, dtype="float32", device="cpu", with_vision=False, with_audio=False)


@pytest.mark.parametrize(
    "name,kernel",
    [("all", False), ("moe", False), ("moe", True)],  # the interpreter is slow: one model through the kernel
    ids=["e", "moe", "moe-triton-interpreted"],
)
def test_fused_layout_with_adapter_equals_merged(lora_adapter, monkeypatch, name, kernel):
    base, adapter_dir, merged = lora_adapter(name)
    model = _load(base)
    base_logits = prefill_logits(model, IDS)
    cfg = model.cfg.text
    weights = LoRAWeights(projection_shapes(cfg), 2, 8, torch.float32, torch.device("cpu"))
    weights.load(1, load_peft_adapter(adapter_dir, cfg, 8, torch.float32).weights)
    if kernel:  # the kernel the GPU runs, here in Triton's interpreter
        monkeypatch.setattr(lora_layer, "add_lora_reference", add_lora)
    slots = torch.full((len(IDS),), 1, dtype=torch.int32)
    unfused = prefill_logits(model, IDS, LoRABatch(weights, slots))
    # x W^T + (x A^T) B^T and x (W + B A)^T round differently (~1e-7), and the random tiny decoder amplifies
    # that to ~1e-3 in the logits over its layers (per module alone: ~2e-4): same argmax, loose bound.
    want = prefill_logits(_load(merged), IDS)
    assert torch.equal(unfused.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(unfused, want, atol=0.05, rtol=0)
    assert (unfused - base_logits).abs().max() > 0.5  # the adapter changes the logits far beyond that bound
    model.language_model.fuse_projections()
    # deltas into the fused outputs' column slices
    fused = prefill_logits(model, IDS, LoRABatch(weights, slots))
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=0)
    # the fast path's stacks: q/k/v and gate/up each one shrink and one expand over a block-diagonal B
    stacked = LoRAWeights(projection_shapes(cfg), 2, 8, torch.float32, torch.device("cpu"), fused=True)
    stacked.load(1, load_peft_adapter(adapter_dir, cfg, 8, torch.float32).weights)
    assert stacked.group_a and stacked.num_bytes > weights.num_bytes
    grouped = prefill_logits(model, IDS, LoRABatch(stacked, slots))
    # A matmul over the stacked ranks rounds differently from one per part; the decoder amplifies that.
    assert torch.equal(grouped.argmax(-1), unfused.argmax(-1))
    torch.testing.assert_close(grouped, unfused, atol=0.02, rtol=0)
    x = torch.randn(len(IDS), cfg.hidden_size)
    by_part, by_group = LoRABatch(weights, slots), LoRABatch(stacked, slots)
    for (layer, group), a in stacked.group_a.items():  # op by op, the two agree to fp32 rounding
        out = stacked.group_b[layer, group].shape[1]
        y0 = torch.randn(len(IDS), out)
        want, got = (
            by_part.add_fused(y0.clone(), x, layer, group),
            by_group.add_fused(y0.clone(), x, layer, group),
        )
        assert a.shape[1] > 8 and (want - y0).abs().max() > 0.1
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stacked.clear(1)  # clearing the slot zeroes the group stacks through their parts' views
    assert all(not t.any() for g in (stacked.group_a, stacked.group_b) for t in g.values())
    # slot -1 everywhere, every module visited: the base model
    none = LoRABatch(weights, torch.full((len(IDS),), -1, dtype=torch.int32), all_modules=True)
    torch.testing.assert_close(prefill_logits(model, IDS, none), base_logits, atol=1e-5, rtol=0)


def test_padded_graph_steps_apply_adapters(lora_adapter):
    """Decode and mixed steps through the graph runners' static buffers (their LoRA row included) give the
    merged models' tokens, with adapters and the base model mixed in one batch."""
    base = lora_adapter("all")[0]
    modules = {n: str(lora_adapter(n)[1]) for n in ("all", "mlp")}
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": IDS[:23]},
        {"prompt_token_ids": IDS[5:12]},
        {"prompt_token_ids": IDS[3:30]},
    ]
    common = dict(device="cpu", dtype="float32", kv_cache_bytes=16 << 20, max_num_seqs=4, text_only=True)
    expected = []
    for name, prompt in zip(["all", None, "mlp"], prompts):
        path = lora_adapter(name)[2] if name else base
        expected.append(LLM(path, **common).generate([prompt], greedy)[0].outputs[0].token_ids)

    engine = LLMEngine(
        EngineConfig(
            model=str(base),
            attention_backend="triton",
            enable_lora=True,
            max_lora_rank=8,
            lora_modules=modules,
            max_num_batched_tokens=32,
            **common,
        )
    )
    runner = engine.runner
    runner.use_graphs(capture=False)
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(10**6))
    lora = [LoRARequest("all"), None, LoRARequest("mlp")]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, lora_request=lora)]
    assert got == expected
    assert runner.num_graph_steps >= 5
