"""The audio tower against transformers' Gemma4AudioModel on feature-extractor inputs (padded batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel as HFAudioModel

from g4serve.config import AudioConfig
from g4serve.models.gemma4.audio import Gemma4AudioModel

# subsampling_conv_channels[0] must equal the 128 mel bins (the reference sizes input_proj_linear from it).
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "subsampling_conv_channels": [128, 4],
    "output_proj_dims": 48,
}
SECONDS = (1, 5)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Replace the degenerate default init (unit norms, zero per_dim_scale, ±inf clip bounds)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("per_dim_scale"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("output_proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.ndim == 1:  # norm scales
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:  # O(1) activations so every part of the layer matters
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
        for name, b in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "input_max", "output_min", "output_max"):
                bound = 1.0 + torch.rand((), generator=g).item() * 1.5  # clips the tails of O(1) activations
                b.fill_(-bound if leaf.endswith("min") else bound)


@pytest.fixture(scope="module")
def models() -> tuple[HFAudioModel, Gemma4AudioModel]:
    torch.manual_seed(0)
    hf = HFAudioModel(Gemma4AudioConfig(**TINY)).eval()
    _randomise(hf, seed=1)
    ours = Gemma4AudioModel(AudioConfig(**TINY)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.fixture(scope="module")
def features() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    waves = [(rng.standard_normal(16_000 * s) * 0.1).astype(np.float32) for s in SECONDS]
    out = Gemma4AudioFeatureExtractor()(waves, return_tensors="pt")
    mask = out["input_features_mask"]
    assert not mask[0].all() and mask[1].all()  # the 1 s clip is padded
    return out


@torch.no_grad()
def test_matches_transformers(models, features):
    hf, ours = models
    x, mask = features["input_features"], features["input_features_mask"]
    expected = hf(x, attention_mask=mask)
    got, got_mask = ours(x, mask)
    assert got_mask.dtype == torch.bool
    assert torch.equal(got_mask, expected.attention_mask)
    assert got.shape == (2, got_mask.shape[1], TINY["output_proj_dims"])
    torch.testing.assert_close(got[got_mask], expected.last_hidden_state[got_mask], atol=1e-5, rtol=1e-6)


@torch.no_grad()
def test_clipping_is_exercised(models, features):
    _, ours = models
    hits = []
    lin = ours.layers[0].feed_forward1.ffw_layer_1
    lin.register_forward_hook(lambda m, i, o: hits.append(bool((i[0].abs() >= m.input_max).any())))
    try:
        ours(features["input_features"], features["input_features_mask"])
    finally:
        lin._forward_hooks.clear()
    assert hits == [True]


@torch.no_grad()
def test_padding_and_batching_do_not_change_valid_frames(models, features):
    _, ours = models
    x, mask = features["input_features"], features["input_features_mask"]
    batched, out_mask = ours(x, mask)
    n = int(mask[0].sum())
    alone, alone_mask = ours(x[:1, :n], mask[:1, :n])
    assert alone_mask.all() and int(alone_mask.sum()) == int(out_mask[0].sum())
    # Bit-exact on CPU: every op is per frame or per block, and the conv is written as elementwise taps.
    assert torch.equal(alone[0], batched[0][out_mask[0]])
    # No mask means every frame is real.
    assert torch.equal(ours(x[1:])[0], batched[1:])


@torch.no_grad()
def test_state_dict_names_and_meta_build(models, features):
    hf, ours = models
    assert set(ours.state_dict()) == set(hf.state_dict())
    for name in ("layers.0.self_attn.per_dim_scale", "layers.0.feed_forward1.ffw_layer_1.input_min"):
        assert name in ours.state_dict()
    persistent = set(ours.state_dict())
    softcaps = {f"layers.{i}.self_attn.softcap" for i in range(TINY["num_hidden_layers"])}
    assert {n for n, _ in ours.named_buffers()} - persistent == {"rel_pos_enc.inv_timescales", *softcaps}
    # Built the way the loader builds: on meta, materialised, non-persistent buffers recomputed.
    with torch.device("meta"):
        fresh = Gemma4AudioModel(AudioConfig(**TINY))
    fresh = fresh.to_empty(device="cpu").eval()
    for module in fresh.modules():
        if hasattr(module, "init_nonpersistent_buffers"):
            module.init_nonpersistent_buffers()
    fresh.load_state_dict(hf.state_dict(), strict=True)
    x, mask = features["input_features"], features["input_features_mask"]
    assert torch.equal(fresh(x, mask)[0], ours(x, mask)[0])
