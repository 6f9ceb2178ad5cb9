"""The vision tower against transformers' Gemma4VisionModel on processor-made inputs; batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel as HFVisionModel

from g4serve.config import VisionConfig
from g4serve.models.gemma4.multimodal import MultimodalEmbedder
from g4serve.models.gemma4.vision import Gemma4VisionModel

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "position_embedding_size": 1024,
}
IMAGE_SIZES = ((100, 100), (100, 300), (500, 64))  # (height, width)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Replace the degenerate default init (unit norms, all-ones position table, ±inf clip bounds)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("position_embedding_table"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:  # O(1) activations so every part of the layer matters
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "input_max", "output_min", "output_max"):
                bound = 1.0 + torch.rand((), generator=g).item() * 1.5  # clips the tails of O(1) activations
                b.fill_(-bound if leaf.endswith("min") else bound)
            elif leaf == "std_bias":
                b.copy_(torch.randn(b.shape, generator=g))
            elif leaf == "std_scale":
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)


def _models(attn: str, **overrides) -> tuple[HFVisionModel, Gemma4VisionModel]:
    torch.manual_seed(0)
    hf = HFVisionModel(Gemma4VisionConfig(**TINY, **overrides, attn_implementation=attn)).eval()
    _randomise(hf, seed=1)
    ours = Gemma4VisionModel(VisionConfig(**TINY, **overrides)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]
    processor = Gemma4ImageProcessor(max_soft_tokens=70, patch_size=16, pooling_kernel_size=3)
    return processor(images, return_tensors="pt")


@pytest.mark.parametrize(
    "attn, overrides",
    [("sdpa", {}), ("eager", {}), ("eager", {"standardize": True, "use_clipped_linears": True})],
    ids=["sdpa", "eager", "standardize+clipped"],
)
@torch.no_grad()
def test_matches_transformers(batch, attn, overrides):
    hf, ours = _models(attn, **overrides)
    pixels, positions = batch["pixel_values"], batch["image_position_ids"]
    expected = hf(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
    got = ours(pixels, positions)
    assert got.shape == (int(batch["num_soft_tokens_per_image"].sum()), TINY["hidden_size"])
    assert got.dtype == torch.float32
    # On CPU g4serve computes attention the eager way: equal to transformers' eager path to the bit.
    # SDPA sums in another order; outputs are O(10) (the pooler scales by sqrt(hidden)).
    if attn == "eager":
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_batch_invariance(batch):
    _, ours = _models("sdpa", standardize=True, use_clipped_linears=True)
    pixels, positions = batch["pixel_values"], batch["image_position_ids"]
    batched = ours(pixels, positions)
    alone = torch.cat([ours(pixels[i : i + 1], positions[i : i + 1]) for i in range(pixels.shape[0])])
    assert torch.equal(batched, alone)
    # Reordering the batch only reorders the output rows.
    counts = batch["num_soft_tokens_per_image"].tolist()
    per_image = torch.split(batched, counts)
    reversed_out = ours(pixels.flip(0), positions.flip(0))
    assert torch.equal(reversed_out, torch.cat(per_image[::-1]))


@torch.no_grad()
def test_fixed_shape_variant_keeps_the_same_tokens(batch):
    """``forward_padded`` (what the encoder CUDA graphs capture) holds ``forward``'s tokens at its used
    cells."""
    _, ours = _models("sdpa", standardize=True, use_clipped_linears=True)
    pixels, positions = batch["pixel_values"], batch["image_position_ids"]
    padded, used = ours.forward_padded(pixels, positions)
    assert padded.shape[:2] == used.shape == (pixels.shape[0], pixels.shape[1] // 9)
    assert used.sum(-1).tolist() == batch["num_soft_tokens_per_image"].tolist()
    torch.testing.assert_close(padded[used], ours(pixels, positions), atol=1e-6, rtol=0)
    # An image cut to its real patches (no padding) gives the same tokens without the attention mask.
    real = (positions[0] >= 0).all(-1)
    pix, pos = pixels[0:1, real], positions[0:1, real]
    unmasked, kept = ours.forward_padded(pix, pos, no_padding=True)
    torch.testing.assert_close(unmasked[kept], ours(pix, pos), atol=1e-6, rtol=0)


@torch.no_grad()
def test_state_dict_names_and_meta_build(batch):
    hf, ours = _models("sdpa", standardize=True, use_clipped_linears=True)
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert "encoder.layers.0.self_attn.q_proj.linear.weight" in ours.state_dict()
    # Built the way the loader builds: on meta, materialised, non-persistent buffers recomputed.
    with torch.device("meta"):
        fresh = Gemma4VisionModel(VisionConfig(**TINY, standardize=True, use_clipped_linears=True))
    fresh = fresh.to_empty(device="cpu").eval()
    for module in fresh.modules():
        if hasattr(module, "init_nonpersistent_buffers"):
            module.init_nonpersistent_buffers()
    fresh.load_state_dict(hf.state_dict(), strict=True)
    pixels, positions = batch["pixel_values"], batch["image_position_ids"]
    assert torch.equal(fresh(pixels, positions), ours(pixels, positions))


@torch.no_grad()
def test_multimodal_embedder_matches_transformers():
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    torch.manual_seed(0)
    hf = Gemma4MultimodalEmbedder(Gemma4VisionConfig(**TINY), Gemma4TextConfig(hidden_size=48))
    ours = MultimodalEmbedder(TINY["hidden_size"], 48, 1e-6)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(7, TINY["hidden_size"]) * 3
    assert torch.equal(ours(x), hf(x))
