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


@pytest.mark.parametrize("variant", ["e", "31b"])  # PLE at the tail's end; the layer scalar and next norm
@pytest.mark.parametrize("tokens", [1, 7])  # the kernel's one-row and tensor-core-tile paths
def test_the_persistent_decode_tail_computes_the_layers_logits(hf_checkpoint, variant, tokens, monkeypatch):
    """Where ``layers.fused.decode_tail_applies`` (on CUDA, 1-8 rows, G4SERVE_DECODE_TAIL=1), each dense layer
    hands everything after its attention to ``kernels.decode_tail``: here taken on CPU tensors (the kernel
    runs in Triton's interpreter), fp32 logits equal the separate ops' to rounding noise."""
    import g4serve.models.gemma4.text as text
    from g4serve.kernels.decode_tail import new_counters

    model = load_model(
        hf_checkpoint(variant), dtype="float32", device="cpu", with_vision=False, with_audio=False
    )
    model.language_model.fuse_projections()
    ids = list(range(10, 10 + tokens))
    separate = prefill_logits(model, ids)
    layers = model.language_model.layers
    for layer in layers:
        layer.decode_counters = new_counters("cpu")
    taken = []

    def applies(h, projections, counters):
        taken.append(len(projections))
        return counters is not None and h.shape[0] <= 8

    monkeypatch.setattr(text, "decode_tail_applies", applies)
    torch.testing.assert_close(prefill_logits(model, ids), separate, atol=1e-4, rtol=0)
    ple = bool(model.cfg.text.hidden_size_per_layer_input)
    assert taken == [5 if ple else 3] * len(layers)  # every layer, with the PLE projections where it has them
    assert all(layer.decode_counters.tolist() == [0] * len(layer.decode_counters) for layer in layers)


@pytest.mark.parametrize("variant", ["e", "31b"])
def test_norms_offer_their_fp8_output_to_the_projection_that_reads_it(hf_checkpoint, variant, monkeypatch):
    """With G4SERVE_FP8_NORM_QUANT and FP8 W8A8 projections, each norm pass that feeds one (the pre-MLP
    norm into gate/up, a layer's last pass into the next layer's q/k/v) quantizes its output for it, and that
    projection takes it: every layer's gate/up and every layer's input projection but the first's. On the CPU
    the projections compute from the dense path, so the logits stay as they were."""
    import g4serve.layers.fused as fused
    from g4serve.layers.quant import QuantLinear

    model = load_model(
        hf_checkpoint(variant),
        dtype="float32",
        device="cpu",
        with_vision=False,
        with_audio=False,
        quantization="fp8",
    )
    model.language_model.fuse_projections()
    ids = list(range(10, 17))
    want = prefill_logits(model, ids)
    monkeypatch.setattr(fused, "FP8_NORM_QUANT", True)
    monkeypatch.setattr(fused, "takes_fp8_groups", lambda x, layer: isinstance(layer, QuantLinear))
    taken = []
    take = QuantLinear.take_quantized_input

    def recording_take(self, x):
        got = take(self, x)
        if got is not None:
            taken.append(self)
        return got

    monkeypatch.setattr(QuantLinear, "take_quantized_input", recording_take)
    torch.testing.assert_close(prefill_logits(model, ids), want, atol=0, rtol=0)
    layers = model.language_model.layers
    readers = [layer.mlp.gate_up_proj for layer in layers] + [
        layer.self_attn.input_projection for layer in layers[1:]
    ]
    assert all(isinstance(p, QuantLinear) for p in readers)
    assert sorted(map(id, taken)) == sorted(map(id, readers))
