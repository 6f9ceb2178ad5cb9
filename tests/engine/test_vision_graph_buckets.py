"""Vision-encoder graphs by frame bucket (engine/cuda_graphs.py: VisionGraphRunner), on the CPU with the
graph capture replaced by a recorder that re-runs the eager encoder into the same static outputs: a batch is
padded to its bucket by repeating its last frame, its own frames' soft tokens are the eager encoder's, larger
batches go in chunks of the largest bucket, and a burst of different frame counts reuses a few graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_standin import fake_capture

from g4serve import LLM
from g4serve.engine import cuda_graphs
from g4serve.engine.cuda_graphs import VisionGraphRunner, frame_buckets
from g4serve.processing.image import rescale_pixels


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", kv_cache_bytes=16 << 20).engine


def _video(engine, frames: int, seed: int):
    rng = np.random.default_rng(seed)
    clip = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(frames)]
    item = engine.process_prompt({"prompt": "<|video|>", "multi_modal_data": {"video": [clip]}}).mm_items[0]
    return rescale_pixels(item.data["pixel_values"], video=True), item.data["position_ids"]


def test_frame_buckets():
    assert frame_buckets(630) == [1, 2, 4, 8, 16, 32, 64]  # 70-token video frames
    assert frame_buckets(2520) == [1, 2, 4, 8, 16]  # 280-token images
    assert frame_buckets(10**6) == [1]


def test_padded_chunked_replays_give_the_eager_soft_tokens(engine, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_capture", fake_capture)
    runner = VisionGraphRunner(engine.model, torch.device("cpu"))
    monkeypatch.setattr(engine.encoder, "vision_graphs", runner)
    pixels, positions = _video(engine, 7, seed=1)
    num_patches = pixels.shape[1]
    # 7 frames: bucket 8 (one repeated frame); then chunks of 2 frames: 2 + 2 + 2 + 1
    for max_patches in (cuda_graphs.MAX_PATCHES_PER_GRAPH, 2 * num_patches):
        monkeypatch.setattr(cuda_graphs, "MAX_PATCHES_PER_GRAPH", max_patches)
        with torch.inference_mode():
            got = engine.encoder.encode_images(pixels, positions)
            want = engine.model.encode_images(pixels, positions)
        assert len(got) == len(want) == 7
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert sorted(key[0] for key in runner._graphs) == [1, 2, 8]


def test_a_burst_of_frame_counts_reuses_the_bucket_graphs(engine, monkeypatch):
    """Frame counts 1..12 need 5 graphs (1, 2, 4, 8, 16 frames), all captured ahead by capture_buckets."""
    monkeypatch.setattr(cuda_graphs, "_capture", fake_capture)
    runner = VisionGraphRunner(engine.model, torch.device("cpu"))
    pixels, positions = _video(engine, 12, seed=2)
    monkeypatch.setattr(cuda_graphs, "MAX_PATCHES_PER_GRAPH", 16 * pixels.shape[1])  # buckets up to 16 frames
    no_padding = bool((positions >= 0).all())
    assert runner.capture_buckets(pixels, positions, no_padding) == len(frame_buckets(pixels.shape[1]))
    captured = dict(runner._graphs)
    with torch.inference_mode():
        for frames in range(1, 13):
            tokens, _ = runner.encode_padded(pixels[:frames], positions[:frames], no_padding)
            want, _ = engine.model.encode_images_padded(pixels[:frames], positions[:frames], no_padding)
            torch.testing.assert_close(tokens, want, atol=1e-5, rtol=1e-5)
    assert runner._graphs == captured  # no capture after warm-up
    with pytest.raises(ValueError, match="at most 16 a graph"):
        runner.encode_padded(torch.cat([pixels, pixels]), torch.cat([positions, positions]), no_padding)


def test_warmup_captures_the_default_image_and_video_buckets(engine, monkeypatch):
    """``LLMEngine._capture_vision_buckets`` (the CUDA warm-up's last step) captures every frame bucket of a
    640x480 image and a 16:9 video frame."""
    monkeypatch.setattr(cuda_graphs, "_capture", fake_capture)
    monkeypatch.setattr(cuda_graphs, "MAX_PATCHES_PER_GRAPH", 3000)  # few buckets: eager encodes on the CPU
    runner = VisionGraphRunner(engine.model, torch.device("cpu"))
    monkeypatch.setattr(engine.encoder, "vision_graphs", runner)
    engine._capture_vision_buckets()
    patches = {key[1] for key in runner._graphs}
    assert len(patches) == 2  # the image's and the video frame's patch counts
    for n in patches:
        assert sorted(key[0] for key in runner._graphs if key[1] == n) == frame_buckets(n)
    assert len(runner._graphs) > len(patches)  # more than one bucket for the smaller frame
