"""The L2 prefetch plan over a loaded model's layers (``Gemma4TextModel.plan_l2_prefetch``)."""

from __future__ import annotations

import pytest
import torch
from test_fast_layout import prefill_logits

from g4serve.layers import prefetch
from g4serve.models.gemma4.loader import load_model


@pytest.mark.parametrize("variant", ["e", "moe", "31b"])
def test_model_plan_follows_each_layers_projections(hf_checkpoint, variant):
    """Each layer's points start at its own projections: ``attn`` at the q/k/v projection (or q alone on a
    KV-shared layer), ``mlp`` at gate/up (or past it where an earlier point reached), ``tail`` at the PLE gate
    (or the next layer's first projection without PLE); the whole stream is asked for exactly once."""
    model = load_model(
        hf_checkpoint(variant), dtype="float32", device="cpu", with_vision=False, with_audio=False
    )
    text = model.language_model
    text.fuse_projections()
    budget = 1024  # bytes: smaller than any projection of the tiny checkpoints, so no window spills over
    text.plan_l2_prefetch(points=("attn", "mlp", "tail"), budget=budget)
    asked = 0
    for i, layer in enumerate(text.layers):
        attn, mlp = layer.self_attn, layer.mlp
        first = {name: regions[0] for name, regions in layer.l2_prefetch.items()}
        if i == 0 or text.layers[i - 1].ple_dim:
            assert first["attn"][0] is attn.input_projection.weight and first["attn"][1] == 0
        else:  # the previous layer's tail point stands at the same place and asked for it already
            assert "attn" not in first
        assert first["mlp"][0] is mlp.gate_up_proj.weight and first["mlp"][1] == 0
        if layer.ple_dim:
            assert first["tail"][0] is layer.per_layer_input_gate.weight
        elif i + 1 < len(text.layers):
            assert first["tail"][0] is text.layers[i + 1].self_attn.input_projection.weight
        else:
            assert "tail" not in first  # nothing after the last layer
        for regions in layer.l2_prefetch.values():
            assert sum(n for _, _, n in regions) <= budget
            asked += sum(n for _, _, n in regions)
    assert 0 < asked <= sum(
        w.numel() * w.element_size() for layer in text.layers for m in layer.streamed_weights()
        if (w := prefetch.streamed_weight(m)) is not None
    )  # fmt: skip


def test_a_planned_model_computes_the_same_logits_on_cpu(hf_checkpoint):
    """On the CPU path the points launch nothing, so a plan leaves every output as it was."""
    model = load_model(hf_checkpoint("e"), dtype="float32", device="cpu", with_vision=False, with_audio=False)
    model.language_model.fuse_projections()
    ids = list(range(10, 30))
    before = prefill_logits(model, ids[:1])
    model.language_model.plan_l2_prefetch(points=("attn", "mlp", "tail"), budget=1 << 20)
    assert any(layer.l2_prefetch for layer in model.language_model.layers)
    assert torch.equal(prefill_logits(model, ids[:1]), before)
