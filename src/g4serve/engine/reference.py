"""Unbatched reference generation: one request at a time, whole prompt in one prefill.

The simplest correct path through the model (contiguous blocks, no scheduling); the engine's
batched outputs are tested against it.
"""

from __future__ import annotations

import time

import torch

from g4serve.engine.request import Request
from g4serve.layers.attention import PagedKVCache, TorchAttention, contiguous_metadata
from g4serve.layers.sampler import SamplingBatch, sample
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.processing.image import rescale_pixels
from g4serve.processing.processor import MultimodalItem, bidirectional_spans

BLOCK_SIZE = 16


@torch.inference_mode()
def encode_items(model: Gemma4Model, items: list[MultimodalItem]) -> torch.Tensor | None:
    """Soft tokens of all items, concatenated in prompt order."""
    if not items:
        return None
    device = next(model.parameters()).device
    dtype = model.language_model.embed_tokens.weight.dtype
    outs = []
    for item in sorted(items, key=lambda it: it.offset):
        if item.modality in ("image", "video"):
            pixels = rescale_pixels(item.data["pixel_values"].to(device), video=item.modality == "video").to(dtype)
            positions = item.data["position_ids"].to(device)
            outs.extend(model.encode_images(pixels, positions))
        else:
            feats = item.data["input_features"].to(device, dtype)
            mask = item.data["input_features_mask"].to(device)
            outs.extend(model.encode_audio(feats, mask))
    return torch.cat(outs, dim=0)


@torch.inference_mode()
def generate_one(model: Gemma4Model, request: Request) -> Request:
    """Run ``request`` to completion and return it (mutated in place)."""
    cfg = model.cfg.text
    device = next(model.parameters()).device
    dtype = model.language_model.embed_tokens.weight.dtype
    total = len(request.prompt_token_ids) + request.max_output_tokens
    num_blocks = -(-total // BLOCK_SIZE)
    cache = PagedKVCache(cfg, {"sliding_attention": num_blocks, "full_attention": num_blocks}, BLOCK_SIZE, dtype, device)
    backend = TorchAttention(cfg, cache)
    table = list(range(num_blocks))
    tables = {"sliding_attention": [table], "full_attention": [table]}
    spans = [bidirectional_spans(request.mm_items)]
    request.init_generator(device)
    request.metrics.first_scheduled_time = time.monotonic()
    t0 = time.monotonic()
    mm_embeds = encode_items(model, request.mm_items)
    request.metrics.encoder_time_s = time.monotonic() - t0

    tokens = request.prompt_token_ids
    computed = 0
    while not request.finished:
        meta = contiguous_metadata([computed], [len(tokens)], tables, BLOCK_SIZE, device, spans)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        hidden = model(ids, meta, backend, mm_embeds=mm_embeds if computed == 0 else None, keep_indices=[len(tokens) - 1])
        logits = model.compute_logits(hidden)
        batch = SamplingBatch.build(
            [request.sampling_params], [request.generator], logits.shape[-1], device,
            output_tokens=[request.output_token_ids], prompt_tokens=[request.prompt_token_ids],
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
