"""Audio-encoder graphs by bucket (engine/cuda_graphs.py: AudioGraphRunner), on the CPU with the graph capture
replaced by a recorder that re-runs the eager encoder into the same static outputs: clips of several lengths
padded along time to their frame bucket and in number to their clip bucket give the eager encoder's soft
tokens, batches past the largest bucket go in chunks, and a burst of lengths reuses a few graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_standin import fake_capture

from g4serve import LLM
from g4serve.engine import cuda_graphs
from g4serve.engine.cuda_graphs import AudioGraphRunner, audio_buckets


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", kv_cache_bytes=16 << 20).engine


def _clips(engine, seconds: list[float]):
    rng = np.random.default_rng(len(seconds))
    audio = [(0.2 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in seconds]
    prompt = "".join("<|audio|>" for _ in audio)
    return engine.process_prompt({"prompt": prompt, "multi_modal_data": {"audio": audio}}).mm_items


def test_audio_buckets():
    assert audio_buckets(1) == (128, [1, 2, 4, 8, 16, 32, 64, 128])
    assert audio_buckets(250)[0] == 256
    assert audio_buckets(3001) == (4096, [1, 2, 4])  # 30 s of audio, 10 ms frames


def test_padded_replays_give_the_eager_soft_tokens(engine, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_capture", fake_capture)
    runner = AudioGraphRunner(engine.model, torch.device("cpu"))
    items = _clips(engine, [0.7, 2.3, 1.1, 0.4, 1.6])
    want = {}
    for item in items:  # one clip at a time, eagerly: no padding at all
        feats, mask = engine.encoder._audio_batch([item])
        (want[item.content_hash],) = engine.model.encode_audio(feats, mask, [item.num_tokens])
    monkeypatch.setattr(engine.encoder, "audio_graphs", runner)
    # 5 clips: padded to 8 in one 256-frame graph; then at most 2 clips a graph (chunks of 2 + 2 + 1)
    for max_frames in (cuda_graphs.MAX_AUDIO_FRAMES_PER_GRAPH, 2 * 256):
        monkeypatch.setattr(cuda_graphs, "MAX_AUDIO_FRAMES_PER_GRAPH", max_frames)
        outputs: dict[str, torch.Tensor] = {}
        call = engine.encoder._encode_audio(items, outputs)
        assert call.num_items == 5
        for item in items:
            got = outputs[item.content_hash]
            assert got.shape[0] == item.num_tokens
            torch.testing.assert_close(got, want[item.content_hash], rtol=1e-4, atol=1e-5)
    assert len(runner._graphs) <= 4  # (8 clips, 256 frames), then (2, 256) and (1, 256) at most


def test_warm_up_captures_every_frame_bucket_of_one_clip(engine, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_capture", fake_capture)
    runner = AudioGraphRunner(engine.model, torch.device("cpu"))
    monkeypatch.setattr(engine.encoder, "audio_graphs", runner)
    (item,) = _clips(engine, [5.0])  # 501 frames: buckets 128, 256, 512
    assert engine.encoder.capture_audio_buckets(item) == 3
    assert {key[:2] for key in runner._graphs} == {(1, 128), (1, 256), (1, 512)}
    assert engine.encoder.capture_audio_buckets(item) == 0
