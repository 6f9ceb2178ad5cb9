"""The processed-media cache (processing/media_cache.py): a media item sent again as the same bytes is taken
from the cache, equal to its first processing, charged to the request's budget as processing charged it,
keyed by the limits too, bounded by bytes; the host path and the device path (run on the CPU) both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from g4serve.config import preset
from g4serve.processing import processor as processor_module
from g4serve.processing.limits import MediaBudgetError, MediaLimits
from g4serve.processing.media_cache import CachedMedia, MediaCache, encoded_parts, media_key
from g4serve.processing.processor import Gemma4Processor
from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer
from tests.processing.test_device_media import jpeg, picture
from tests.processing.test_media_hostile import _frames, _png, _video, _wav

LIMITS = {"image": 8, "video": 4, "audio": 4}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(params=["host", "device"])
def pair(request, tokenizer) -> tuple[Gemma4Processor, Gemma4Processor]:
    """(a processor with the cache, one without) on the host path or the device path (on the CPU)."""
    device = "cpu" if request.param == "device" else None
    return (
        Gemma4Processor(tokenizer, preset("tiny"), media_device=device, cache_bytes=64 << 20),
        Gemma4Processor(tokenizer, preset("tiny"), media_device=device),
    )


def _media() -> dict[str, list]:
    tone = (0.3 * np.sin(np.arange(16_000) * 0.05)).astype(np.float32)
    frames = [jpeg(picture(96, 144, seed=10 + i)) for i in range(4)]
    return {
        "image": [jpeg(picture(120, 160, seed=1)), _png(40, 30)],
        "video": [frames, _video(_frames(6))],
        "audio": [_wav(tone, 16_000)],
    }


def _prompt(p: Gemma4Processor, media: dict[str, list]) -> dict:
    tokens = {"image": p.image_token, "video": p.video_token, "audio": p.audio_token}
    text = " ".join(tokens[m] for m, values in media.items() for _ in values)
    return {"prompt": text, "multi_modal_data": media}


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    for x, y in zip(a.mm_items, b.mm_items, strict=True):
        assert x.modality == y.modality and x.spans == y.spans and x.content_hash == y.content_hash
        assert x.data.keys() == y.data.keys()
        for name in x.data:
            assert torch.equal(x.data[name].cpu(), y.data[name].cpu()), name


def test_media_sent_again_come_from_the_cache(pair, monkeypatch):
    cached, plain = pair
    media = _media()
    first = cached.process(_prompt(cached, media), LIMITS)
    assert len(cached.cache) == 5 and cached.cache.misses == 5 and cached.cache.hits == 0
    # A second request with the same bytes (fresh objects: equal, not identical) never decodes them.
    for name in ("preprocess_images", "preprocess_video"):
        monkeypatch.setattr(processor_module, name, lambda *a, **k: pytest.fail("processed again"))
    monkeypatch.setattr(cached, "audio_extractor", lambda *a, **k: pytest.fail("processed again"))
    again = cached.process(_prompt(cached, _media()), LIMITS)
    assert cached.cache.hits == 5
    _same(first, again)
    monkeypatch.undo()
    # Equal to what a processor without the cache makes of them, but for the content hash: the cache's is
    # the encoded bytes' (no read-back of the patches), the plain one's the patches'.
    reference = plain.process(_prompt(plain, media), LIMITS)
    assert first.token_ids == reference.token_ids
    for x, y in zip(first.mm_items, reference.mm_items, strict=True):
        assert x.content_hash.startswith("raw:") and not y.content_hash.startswith("raw:")
        for name in x.data:
            assert torch.equal(x.data[name].cpu(), y.data[name].cpu()), name


def test_hits_are_charged_to_the_request_budget(pair):
    """A request refused without the cache is refused with it: a hit charges the pixels its processing did."""
    cached, plain = pair
    image = jpeg(picture(120, 160, seed=3))
    limits = MediaLimits(max_request_pixels=120 * 160 * 2)
    one = {"prompt": cached.image_token, "multi_modal_data": {"image": [image]}}
    cached.process(one, LIMITS, media_limits=limits)  # cached now
    three = {"prompt": cached.image_token * 3, "multi_modal_data": {"image": [image] * 3}}
    for p in (plain, cached):
        with pytest.raises(MediaBudgetError, match="max_request_pixels"):
            p.process(three, LIMITS, media_limits=limits)
    tone = (0.3 * np.sin(np.arange(16_000) * 0.05)).astype(np.float32)
    clip = {"prompt": cached.audio_token * 2, "multi_modal_data": {"audio": [_wav(tone, 16_000)] * 2}}
    audio_limits = MediaLimits(max_request_audio_seconds=1.5)
    cached.process(
        {
            **clip,
            "prompt": cached.audio_token,
            "multi_modal_data": {"audio": clip["multi_modal_data"]["audio"][:1]},
        },
        LIMITS,
        media_limits=audio_limits,
    )
    with pytest.raises(MediaBudgetError, match="max_request_audio_seconds"):
        cached.process(clip, LIMITS, media_limits=audio_limits)


def test_the_key_holds_the_limits_and_every_byte():
    limits = MediaLimits()
    frames = [b"\xff\xd8one", b"\xff\xd8two"]
    key = media_key("video", frames, limits)
    assert key == media_key("video", [bytearray(f) for f in frames], limits)
    assert key != media_key("image", frames, limits)
    assert key != media_key("video", frames, MediaLimits(max_media_pixels=100))
    assert key != media_key(
        "video", [b"\xff\xd8on", b"e\xff\xd8two"], limits
    )  # the same bytes, cut elsewhere
    assert key != media_key("video", frames[::-1], limits)
    assert encoded_parts(b"x") == [b"x"] and encoded_parts([b"x", bytearray(b"y")]) == [b"x", b"y"]
    assert encoded_parts("a/path.png") is None and encoded_parts([b"x", np.zeros(3)]) is None
    assert encoded_parts([]) is None


def test_unkeyed_media_are_hashed_by_content(tokenizer):
    """Decoded images (arrays, PIL) are processed every time and hashed by their patches, as before."""
    p = Gemma4Processor(tokenizer, preset("tiny"), cache_bytes=64 << 20)
    array = picture(64, 80, seed=5)
    prompt = {"prompt": p.image_token, "multi_modal_data": {"image": [array]}}
    a, b = p.process(prompt, LIMITS), p.process(prompt, LIMITS)
    assert len(p.cache) == 0 and a.mm_items[0].content_hash == b.mm_items[0].content_hash
    assert not a.mm_items[0].content_hash.startswith("raw:")


def test_the_cache_is_bounded_by_bytes_least_recent_first():
    def item(n: int) -> CachedMedia:
        return CachedMedia({"x": torch.zeros(n, dtype=torch.uint8)}, f"h{n}", "")

    cache = MediaCache(1000)
    cache.put("a", item(400))
    cache.put("b", item(400))
    assert cache.get("a") is not None  # b is now the least recent
    cache.put("c", item(400))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 800 and len(cache) == 2
    cache.put("huge", item(1001))  # larger than the whole cache: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2
    cache.put("a", item(100))  # replaced: its bytes counted once
    assert cache.bytes == 500


def test_a_view_into_a_batch_is_cloned_for_the_cache():
    from g4serve.processing.media_cache import to_host

    batch = torch.zeros(4, 1000, dtype=torch.uint8)
    kept = to_host({"x": batch[1:2], "y": torch.ones(3)})
    assert kept["x"].untyped_storage().nbytes() == 1000 and torch.equal(kept["x"], batch[1:2])


def test_a_failed_request_keeps_nothing(tokenizer):
    """Items processed before a later one fails are not kept: only whole requests populate the cache."""
    p = Gemma4Processor(tokenizer, preset("tiny"), cache_bytes=64 << 20)
    good = jpeg(picture(64, 80, seed=6))
    prompt = {"prompt": p.image_token * 2, "multi_modal_data": {"image": [good, b"not an image"]}}
    with pytest.raises(ValueError, match=r"image\[1\]"):
        p.process(prompt, LIMITS)
    assert len(p.cache) == 0


def test_errors_name_the_item_among_hits(tokenizer):
    """With the first image cached, a bad second one is still named image[1]."""
    p = Gemma4Processor(tokenizer, preset("tiny"), cache_bytes=64 << 20)
    good = jpeg(picture(64, 80, seed=7))
    p.process({"prompt": p.image_token, "multi_modal_data": {"image": [good]}}, LIMITS)
    prompt = {"prompt": p.image_token * 2, "multi_modal_data": {"image": [good, b"not an image"]}}
    with pytest.raises(ValueError, match=r"image\[1\]"):
        p.process(prompt, LIMITS)


def test_a_prompt_that_fails_after_its_media_keeps_nothing(tokenizer):
    p = Gemma4Processor(tokenizer, preset("tiny"), cache_bytes=64 << 20)
    image = jpeg(picture(64, 80, seed=8))
    with pytest.raises(ValueError, match="placeholder"):  # two placeholders, one image
        p.process({"prompt": p.image_token * 2, "multi_modal_data": {"image": [image]}}, LIMITS)
    assert len(p.cache) == 0


def test_a_device_items_host_copy_is_made_later_and_a_hit_waits_for_it(monkeypatch):
    """put(later=True) (what a device item gets) returns before the read-back; get waits for it and hands
    out the host copy, and every get of it is a hit."""
    import threading

    from g4serve.processing import media_cache

    release, copying = threading.Event(), threading.Event()
    real = media_cache.to_host

    def slow_to_host(tensors):
        copying.set()
        assert release.wait(10)
        return {name: t.clone() for name, t in real(tensors).items()}

    monkeypatch.setattr(media_cache, "to_host", slow_to_host)
    cache = MediaCache(1000)
    source = torch.arange(100, dtype=torch.uint8)
    cache.put("a", CachedMedia({"x": source}, "h", "<e>"), later=True)  # returns with the copy blocked
    assert copying.wait(10) and cache.bytes == 100 + 3 and len(cache) == 1
    got: list = []
    reader = threading.Thread(target=lambda: got.append(cache.get("a")))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # the hit waits for the copy
    release.set()
    reader.join(10)
    (item,) = got
    assert torch.equal(item.data["x"], source) and item.data["x"].data_ptr() != source.data_ptr()
    assert cache.get("a") is item and cache.stats()["hits"] == 2 and cache.stats()["misses"] == 0


def test_a_failed_host_copy_is_a_miss_and_frees_its_bytes(monkeypatch):
    from g4serve.processing import media_cache

    def broken(tensors):
        raise RuntimeError("device lost")

    monkeypatch.setattr(media_cache, "to_host", broken)
    cache = MediaCache(1000)
    cache.put("a", CachedMedia({"x": torch.zeros(10, dtype=torch.uint8)}, "h", ""), later=True)
    assert cache.get("a") is None
    assert cache.bytes == 0 and len(cache) == 0 and cache.stats()["misses"] == 1
