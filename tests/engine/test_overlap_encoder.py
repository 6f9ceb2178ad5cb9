"""Encoding media ahead of the prefills that need them (``overlap_encoder``): the same tokens as encoding
inside the step, decode steps of other requests keep going while an encode is in flight, and the
host-side selections that keep the side stream free of read-backs equal the device-side ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from test_engine import _audio, _frames, _image, _user, assert_pools_free, make_engine, mixed_prompts

from g4serve.engine.encoder_runner import _Encoding
from g4serve.models.gemma4.vision import avg_pool_by_position, pooling_cells_used
from g4serve.processing.image import rescale_pixels
from g4serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _run(engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params))
    outs = engine.run_until_finished()
    for rid, out in outs.items():  # the encoder's time is charged to the requests with media
        prompt = prompts[int(rid)]
        assert (out.metrics.encoder_time_s > 0) == (
            isinstance(prompt, dict) and engine.encoder.calls != []
        ), rid
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_media_workload_matches_encoding_in_the_step(tiny_model_dir, async_scheduling):
    prompts = mixed_prompts()
    expected = _run(make_engine(tiny_model_dir), prompts)
    engine = make_engine(
        tiny_model_dir, overlap_encoder=True, async_scheduling=async_scheduling, encoder_token_budget=64
    )
    assert _run(engine, prompts) == expected
    assert engine.encoder.num_in_flight == 0 and engine.encoder.calls
    assert not engine.encoder_cache._refs  # every pin released
    assert_pools_free(engine)


def test_decodes_go_on_while_an_encode_is_in_flight(tiny_model_dir, monkeypatch):
    """A request decodes while a video request's encode is held in flight for three polls: the video
    request computes nothing past its media's start meanwhile, and its tokens equal encoding in the step."""
    video = {"prompt": _user("<|video|>What happens?"), "multi_modal_data": {"video": [_frames(3, 4)]}}
    text = _user("savings loan branch payment")
    expected = _run(make_engine(tiny_model_dir), [text, video])

    engine = make_engine(tiny_model_dir, overlap_encoder=True)
    polls = {"n": 0}
    ready = _Encoding.ready

    def slow_ready(encoding):
        polls["n"] += 1
        return polls["n"] > 3 and ready(encoding)

    monkeypatch.setattr(_Encoding, "ready", slow_ready)
    engine.add_request(engine.make_request("0", engine.process_prompt(text), GREEDY))
    engine.step()  # prefill of the text request
    engine.add_request(engine.make_request("1", engine.process_prompt(video), GREEDY))
    video_request = engine.requests["1"]
    media_start = video_request.mm_items[0].offset
    decoded_while_encoding = 0
    outputs = {}
    while engine.has_unfinished_requests():
        waiting_for_media = engine.encoder.num_in_flight > 0
        for out in engine.step():
            outputs[out.request_id] = out
            if waiting_for_media and out.request_id == "0":
                decoded_while_encoding += 1
        if engine.encoder.num_in_flight:
            assert video_request.num_computed_tokens <= media_start  # never into media not encoded yet
    assert decoded_while_encoding >= 2
    assert {rid: o.outputs[0].token_ids for rid, o in outputs.items()} == expected
    assert outputs["1"].metrics.encoder_time_s >= 0.0
    assert_pools_free(engine)


def test_requests_behind_one_waiting_for_its_encoder_are_admitted(tiny_model_dir, monkeypatch):
    video = {"prompt": _user("<|video|>What happens?"), "multi_modal_data": {"video": [_frames(4, 4)]}}
    engine = make_engine(tiny_model_dir, overlap_encoder=True)
    monkeypatch.setattr(_Encoding, "ready", lambda encoding: False)
    engine.add_request(engine.make_request("video", engine.process_prompt(video), GREEDY))
    engine.add_request(engine.make_request("text", engine.process_prompt(_user("hello")), GREEDY))
    batch = engine.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["text"] and len(batch.encoder_items) == 1
    assert [r.request_id for r in engine.scheduler.waiting] == ["video"]


def test_all_media_of_a_request_start_encoding_at_once(tiny_model_dir):
    prompt = {
        "prompt": _user("<|image|> then <|audio|> then <|image|>"),
        "multi_modal_data": {
            "image": [
                Image.fromarray(np.full((40, 56, 3), 9, np.uint8)),
                Image.fromarray(np.full((56, 40, 3), 200, np.uint8)),
            ],
            "audio": _audio(5, 1.0),
        },
    }
    expected = _run(make_engine(tiny_model_dir), [prompt])
    for min_text, computed in ((256, 0), (4, 7)):
        # The 7 text tokens before the first image wait for it, unless text that short may run ahead.
        engine = make_engine(tiny_model_dir, overlap_encoder=True)
        engine.scheduler.min_text_before_pending_media = min_text
        engine.add_request(engine.make_request("0", engine.process_prompt(prompt), GREEDY))
        engine.step()
        assert engine.encoder.num_in_flight == 3  # both images and the clip, before any of them is needed
        assert engine.requests["0"].mm_items[0].offset == 7
        assert engine.requests["0"].num_computed_tokens == computed
        assert {rid: o.outputs[0].token_ids for rid, o in engine.run_until_finished().items()} == expected


def test_pooling_cells_used_matches_pooling(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    images = [
        Image.fromarray(np.zeros((64, 96, 3), np.uint8)),
        Image.fromarray(np.zeros((120, 40, 3), np.uint8)),
    ]
    processed = engine.process_prompt({"prompt": "<|image|><|image|>", "multi_modal_data": {"image": images}})
    k = engine.model_config.vision.pooling_kernel_size
    for item in processed.mm_items:
        positions = item.data["position_ids"]
        length = positions.shape[1] // k**2
        _, used = avg_pool_by_position(torch.zeros(*positions.shape[:2], 1), positions, k, length)
        assert torch.equal(pooling_cells_used(positions, k, length), used)
        assert int(used.sum()) == item.num_tokens


def test_host_side_selections_equal_device_side(tiny_model_dir):
    """What the side stream uses instead of reading masks back: the fixed-shape encoder with a host-made
    index for images, prefix slices of the placeholder counts for audio."""
    engine = make_engine(tiny_model_dir)
    processed = engine.process_prompt(
        {
            "prompt": "<|image|><|audio|><|audio|>",
            "multi_modal_data": {
                "image": Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8)),
                "audio": [_audio(1, 1.0), _audio(2, 2.5)],
            },
        }
    )
    image, *clips = processed.mm_items
    model = engine.model
    with torch.inference_mode():
        pixels = rescale_pixels(image.data["pixel_values"])
        want = model.encode_images(pixels, image.data["position_ids"])
        engine.encoder.stream = "side"  # only its presence matters to encode_images' choice of path
        got = engine.encoder.encode_images(pixels, image.data["position_ids"])
        engine.encoder.stream = None
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        length = max(c.data["input_features"].shape[1] for c in clips)
        feats = torch.cat(
            [
                torch.nn.functional.pad(
                    c.data["input_features"], (0, 0, 0, length - c.data["input_features"].shape[1])
                )
                for c in clips
            ]
        )
        masks = torch.cat(
            [
                torch.nn.functional.pad(
                    c.data["input_features_mask"], (0, length - c.data["input_features_mask"].shape[1])
                )
                for c in clips
            ]
        )
        masked = model.encode_audio(feats, masks)
        sliced = model.encode_audio(feats, masks, [c.num_tokens for c in clips])
    for a, b in zip(masked, sliced):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overlap_encoder", [False, True])
def test_an_encode_of_two_images_is_charged_once_to_their_request(tiny_model_dir, overlap_encoder):
    """A request's encoder time is the sum of the encodes that held its items, each once: ahead of the step
    both images go in one encode (charged once per image before), in the step one each as the prefill reaches
    them."""
    engine = make_engine(tiny_model_dir, overlap_encoder=overlap_encoder)
    prompt = {
        "prompt": _user("<|image|><|image|>Compare them."),
        "multi_modal_data": {"image": [_image(30), _image(31)]},
    }
    engine.add_request(engine.make_request("0", engine.process_prompt(prompt), GREEDY))
    out = engine.run_until_finished()["0"]
    calls = engine.encoder.calls
    assert [c.num_items for c in calls] == ([2] if overlap_encoder else [1, 1])
    assert all(c.seconds > 0 for c in calls)
    assert out.metrics.encoder_time_s == pytest.approx(sum(c.seconds for c in calls))
