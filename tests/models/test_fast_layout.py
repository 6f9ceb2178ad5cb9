"""The fast-path weight layout (q/k/v and gate/up stacked into one GEMM each) computes the same logits."""

from __future__ import annotations

import pytest
import torch

from g4serve.engine.kv_cache import PagedKVCache
from g4serve.layers.attention import TorchAttention, contiguous_metadata
from g4serve.models.gemma4.loader import load_model


def prefill_logits(model, ids: list[int], lora=None) -> torch.Tensor:
    """The logits of every position of one prompt, through the reference attention (``lora``: a LoRABatch)."""
    cfg = model.cfg.text
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    cache = PagedKVCache(
        cfg, {"sliding_attention": blocks, "full_attention": blocks}, bs, torch.float32, "cpu"
    )
    table = list(range(blocks))
    meta = contiguous_metadata(
        [0], [n], {"sliding_attention": [table], "full_attention": [table]}, bs, "cpu", [[]]
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta, TorchAttention(cfg, cache), lora=lora))


@pytest.mark.parametrize("variant", ["e", "moe", "31b"])  # PLE + KV sharing; MoE; K-as-V full layers
def test_fused_projections_match(hf_checkpoint, variant):
    model = load_model(
        hf_checkpoint(variant), dtype="float32", device="cpu", with_vision=False, with_audio=False
    )
    ids = list(range(10, 50))
    before = prefill_logits(model, ids)
    model.language_model.fuse_projections()
    attn = [layer.self_attn for layer in model.language_model.layers]
    assert any(a.qkv_proj is not None for a in attn)
    assert all(a.q_proj is None for a in attn if a.qkv_proj is not None)
    torch.testing.assert_close(prefill_logits(model, ids), before, atol=1e-5, rtol=0)


def test_unbounded_clipping_is_dropped_and_bounded_kept():
    from g4serve.models.gemma4.multimodal import ClippableLinear

    unbounded, bounded = ClippableLinear(8, 4, True), ClippableLinear(8, 4, True)
    bounded.output_max.fill_(0.1)
    x = torch.randn(3, 8)
    before = unbounded(x)
    unbounded.drop_unbounded_clipping()
    bounded.drop_unbounded_clipping()
    assert not unbounded.use_clipping and bounded.use_clipping
    assert torch.equal(unbounded(x), before)
    assert bounded(x).max() <= 0.1


@pytest.mark.parametrize("variant", ["e", "31b"])  # PLE after the MLP block; the layer scalar and next norm
def test_the_persistent_mlp_block_takes_the_layers_own_operands(hf_checkpoint, variant, monkeypatch):
    """Where ``layers.fused.decode_mlp_block`` applies (CUDA, decode sizes, G4SERVE_DECODE_MLP=1), each dense
    layer hands it the operands of its separate ops: with a stand-in computing the kernel's torch reference
    from what it is handed, the logits equal those of the separate ops."""
    import g4serve.models.gemma4.text as text
    from g4serve.kernels.decode_mlp import decode_mlp_reference

    model = load_model(
        hf_checkpoint(variant), dtype="float32", device="cpu", with_vision=False, with_audio=False
    )
    model.language_model.fuse_projections()
    ids = list(range(10, 50))
    separate = prefill_logits(model, ids)
    calls = []

    def block(x, residual, gate_up, down, activation, norm, counters, scale=None, next_norm=None):
        calls.append((scale is not None, next_norm is not None))
        next_weight = next_norm.weight if next_norm is not None else None
        return decode_mlp_reference(
            x, residual, gate_up.weight, down.weight, norm.weight, norm.eps, activation, scale, next_weight
        )

    monkeypatch.setattr(text, "decode_mlp_block", block)
    torch.testing.assert_close(prefill_logits(model, ids), separate, atol=1e-5, rtol=0)
    layers = model.language_model.layers
    assert len(calls) == len(layers)
    ple = bool(model.cfg.text.hidden_size_per_layer_input)
    assert set(calls) == ({(False, False)} if ple else {(True, True)})  # PLE: the scalar and norm come later
