"""g4serve's Gemma 4 against transformers on tiny random checkpoints: logits and greedy tokens.

Inputs come from g4serve's processor and are fed unchanged to both models, so these tests
isolate the model; tests/processing compares the processors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from g4serve import LLM, SamplingParams
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.layers.attention import TorchAttention, contiguous_metadata
from g4serve.processing.image import rescale_pixels
from g4serve.processing.processor import bidirectional_spans
from g4serve.reference import encode_items

LOGIT_ATOL = 1e-4


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _frames(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(n)]


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * 300 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


PROMPTS = {
    "text": (
        "<|turn>user\nHow much money is in my savings account, and when was the last transfer?"
        "<turn|>\n<|turn>model\n",
        {},
    ),
    "image": (
        "<|turn>user\n<|image|>What is in this picture? And <|image|> this one?<turn|>\n<|turn>model\n",
        {"image": [_image(120, 200, 0), _image(300, 90, 1)]},
    ),
    "video": (
        "<|turn>user\n<|video|>What happens in the video?<turn|>\n<|turn>model\n",
        {"video": [_frames(6, 2)]},
    ),
    "video1": ("<|turn>user\n<|video|>Describe it.<turn|>\n<|turn>model\n", {"video": [_frames(1, 3)]}),
    "audio": (
        "<|turn>user\n<|audio|>Transcribe, then answer: <|audio|><turn|>\n<|turn>model\n",
        {"audio": [_audio(1.0, 4), _audio(5.0, 5)]},
    ),
}

CASES = [
    ("e", "text"),
    ("e", "image"),
    ("e", "video"),
    ("e", "video1"),
    ("e", "audio"),
    ("moe", "text"),
    ("moe", "image"),
    ("moe", "video"),
    ("31b", "text"),
    ("31b", "image"),
    ("31b", "video"),
]


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    from transformers import Gemma4ForConditionalGeneration

    cache = {}

    def get(variant):
        if variant not in cache:
            path = hf_checkpoint(variant)
            # Eager attention: the reference math. (SDPA differs from eager itself by up to ~4e-4 on
            # these deliberately large random weights; g4serve matches eager to the bit on text.)
            hf = Gemma4ForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            cache[variant] = (LLM(str(path), device="cpu", dtype="float32"), hf)
        return cache[variant]

    return get


def _hf_inputs(llm: LLM, processed) -> dict:
    """The processed prompt as keyword arguments of transformers' Gemma4ForConditionalGeneration."""
    ids = torch.tensor([processed.token_ids])
    cfg = llm.config
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mm_types = torch.zeros_like(ids)
    mm_types[ids == cfg.image_token_id] = 1
    mm_types[ids == cfg.video_token_id] = 2
    mm_types[ids == cfg.audio_token_id] = 3
    kwargs["mm_token_type_ids"] = mm_types
    by_modality: dict[str, list] = {}
    for item in processed.mm_items:
        by_modality.setdefault(item.modality, []).append(item)
    if "image" in by_modality:
        kwargs["pixel_values"] = torch.cat(
            [rescale_pixels(it.data["pixel_values"]) for it in by_modality["image"]]
        )
        kwargs["image_position_ids"] = torch.cat([it.data["position_ids"] for it in by_modality["image"]])
    if "video" in by_modality:
        kwargs["pixel_values_videos"] = torch.cat(
            [rescale_pixels(it.data["pixel_values"], video=True) for it in by_modality["video"]]
        )
        kwargs["video_position_ids"] = torch.cat([it.data["position_ids"] for it in by_modality["video"]])
        kwargs["num_frames_per_video"] = torch.tensor(
            [it.data["pixel_values"].shape[0] for it in by_modality["video"]]
        )
    if "audio" in by_modality:
        feats = [it.data["input_features"] for it in by_modality["audio"]]
        masks = [it.data["input_features_mask"] for it in by_modality["audio"]]
        length = max(f.shape[1] for f in feats)
        kwargs["input_features"] = torch.cat(
            [torch.nn.functional.pad(f, (0, 0, 0, length - f.shape[1])) for f in feats]
        )
        kwargs["input_features_mask"] = torch.cat(
            [torch.nn.functional.pad(m, (0, length - m.shape[1])) for m in masks]
        )
    return kwargs


def _our_logits(llm: LLM, processed) -> torch.Tensor:
    model, cfg = llm.model, llm.config.text
    n = len(processed.token_ids)
    blocks = -(-n // 16)
    cache = PagedKVCache(
        cfg, {"sliding_attention": blocks, "full_attention": blocks}, 16, torch.float32, "cpu"
    )
    table = list(range(blocks))
    meta = contiguous_metadata(
        [0],
        [n],
        {"sliding_attention": [table], "full_attention": [table]},
        16,
        "cpu",
        [bidirectional_spans(processed.mm_items)],
    )
    with torch.inference_mode():
        hidden = model(
            torch.tensor(processed.token_ids),
            meta,
            TorchAttention(cfg, cache),
            mm_embeds=encode_items(model, processed.mm_items),
        )
        return model.compute_logits(hidden)


@pytest.mark.parametrize("variant,prompt", CASES)
def test_logits_match_transformers(models, variant, prompt):
    llm, hf = models(variant)
    text, media = PROMPTS[prompt]
    processed = llm.processor(
        prompt=text, images=media.get("image"), videos=media.get("video"), audio=media.get("audio")
    )
    assert sum(it.num_tokens for it in processed.mm_items) == sum(
        t in (llm.config.image_token_id, llm.config.video_token_id, llm.config.audio_token_id)
        for t in processed.token_ids
    )
    with torch.inference_mode():
        ref = hf(**_hf_inputs(llm, processed)).logits[0]
    ours = _our_logits(llm, processed)
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < LOGIT_ATOL, f"max |logit diff| {diff:.2e}"


@pytest.mark.parametrize(
    "variant,prompt",
    [("e", "text"), ("e", "image"), ("e", "audio"), ("moe", "video"), ("31b", "image"), ("31b", "text")],
)
def test_greedy_tokens_match_transformers(models, variant, prompt):
    llm, hf = models(variant)
    text, media = PROMPTS[prompt]
    processed = llm.processor(
        prompt=text, images=media.get("image"), videos=media.get("video"), audio=media.get("audio")
    )
    inputs = _hf_inputs(llm, processed)
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=32, do_sample=False)[
            0, len(processed.token_ids) :
        ].tolist()
    out = llm.generate(
        {"prompt": text, "multi_modal_data": media}, SamplingParams(temperature=0, max_tokens=32)
    )[0]
    assert out.prompt_token_ids == processed.token_ids
    assert out.outputs[0].token_ids == ref[: len(out.outputs[0].token_ids)]
    assert len(out.outputs[0].token_ids) == len(ref)
