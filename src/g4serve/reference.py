"""Unbatched reference generation: one request at a time, whole prompt in one prefill.

The simplest correct path through the model (contiguous blocks, no scheduling); the engine's
batched outputs are tested against it.
"""

from __future__ import annotations

import time

import torch

from g4serve.engine.kv_cache import PagedKVCache
from g4serve.engine.request import Request
from g4serve.layers.attention import TorchAttention, contiguous_metadata
from g4serve.layers.sampler import SamplingBatch, sample
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.processing.image import rescale_pixels
from g4serve.processing.processor import MultimodalItem, bidirectional_spans

BLOCK_SIZE = 16


@torch.inference_mode()
def encode_items(model: Gemma4Model, items: list[MultimodalItem]) -> torch.Tensor | None:
    """Soft tokens of all items, concatenated in prompt order.

    Items are encoded as transformers batches them: all images of the prompt in one call, all video
    frames in one, all audio clips (padded to the longest) in one. The same GEMM shapes as the oracle make
    this path equal to it bit for bit on any CPU; one call per item does not: BLAS picks its kernel by the
    row count, and on AVX-512 a lone image's soft tokens differ by an ulp or two (bench/parity_drift.py).
    """
    if not items:
        return None
    device = next(model.parameters()).device
    dtype = model.language_model.embed_tokens.weight.dtype
    tokens: dict[int, list[torch.Tensor]] = {}  # id(item) -> its soft tokens (one tensor per image / frame)
    groups: dict[tuple[str, int], list[MultimodalItem]] = {}
    for item in items:
        if item.modality in ("image", "video"):
            groups.setdefault((item.modality, item.data["pixel_values"].shape[1]), []).append(item)
    for (modality, _), group in groups.items():
        pixels = torch.cat(
            [rescale_pixels(it.data["pixel_values"].to(device), video=modality == "video") for it in group]
        ).to(dtype)
        per_input = model.encode_images(
            pixels, torch.cat([it.data["position_ids"] for it in group]).to(device)
        )
        cursor = 0
        for item in group:
            frames = item.data["pixel_values"].shape[0]
            tokens[id(item)] = per_input[cursor : cursor + frames]
            cursor += frames
    clips = [it for it in items if it.modality == "audio"]
    if clips:
        length = max(it.data["input_features"].shape[1] for it in clips)
        pad = torch.nn.functional.pad
        feats = torch.cat(
            [
                pad(it.data["input_features"], (0, 0, 0, length - it.data["input_features"].shape[1]))
                for it in clips
            ]
        ).to(device, dtype)
        masks = torch.cat(
            [
                pad(it.data["input_features_mask"], (0, length - it.data["input_features_mask"].shape[1]))
                for it in clips
            ]
        ).to(device)
        for item, clip_tokens in zip(clips, model.encode_audio(feats, masks)):
            tokens[id(item)] = [clip_tokens]
    return torch.cat([t for item in sorted(items, key=lambda it: it.offset) for t in tokens[id(item)]], dim=0)


@torch.inference_mode()
def generate_one(model: Gemma4Model, request: Request) -> Request:
    """Run ``request`` to completion and return it (mutated in place)."""
    cfg = model.cfg.text
    device = next(model.parameters()).device
    dtype = model.language_model.embed_tokens.weight.dtype
    total = len(request.prompt_token_ids) + request.max_output_tokens
    num_blocks = -(-total // BLOCK_SIZE)
    cache = PagedKVCache(
        cfg, {"sliding_attention": num_blocks, "full_attention": num_blocks}, BLOCK_SIZE, dtype, device
    )
    backend = TorchAttention(cfg, cache)
    table = list(range(num_blocks))
    tables = {"sliding_attention": [table], "full_attention": [table]}
    spans = [bidirectional_spans(request.mm_items)]
    request.metrics.first_scheduled_time = time.monotonic()
    t0 = time.monotonic()
    mm_embeds = encode_items(model, request.mm_items)
    request.metrics.encoder_time_s = time.monotonic() - t0

    tokens = request.prompt_token_ids
    computed = 0
    while not request.finished:
        meta = contiguous_metadata([computed], [len(tokens)], tables, BLOCK_SIZE, device, spans)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        hidden = model(
            ids, meta, backend, mm_embeds=mm_embeds if computed == 0 else None, keep_indices=[len(tokens) - 1]
        )
        logits = model.compute_logits(hidden)
        batch = SamplingBatch.build(
            [request.sampling_params],
            [request.sampling_params.seed],
            logits.shape[-1],
            device,
            output_tokens=[request.output_token_ids],
            prompt_tokens=[request.prompt_token_ids],
            positions=[request.num_output_tokens],
        )
        out = sample(logits, batch)
        top = None
        if out.top_ids is not None:
            top = list(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))
        request.append_token(
            int(out.token_ids[0]), None if out.logprobs is None else float(out.logprobs[0]), top
        )
        computed += len(tokens)
        tokens = [request.output_token_ids[-1]]
    request.metrics.finished_time = time.monotonic()
    return request
