"""Videos encoded a few frames a step beside running decodes (``max_encoder_tokens_beside_decodes``): the
same tokens as encoding whole, a step that holds decodes never encodes more than the cap (one frame when a
frame alone is larger), the prefill follows the frames already encoded, and an aborted request leaves no
partial video and no KV blocks behind."""

from __future__ import annotations

import pytest
from test_engine import _frames, _image, _user, assert_pools_free, make_engine, mixed_prompts

from g4serve.engine.config import EngineConfig
from g4serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _video(seed: int, frames: int) -> dict:
    return {"prompt": _user("<|video|>What happens?"), "multi_modal_data": {"video": [_frames(seed, frames)]}}


def _step_all(engine, prompts: dict[str, object], params=GREEDY) -> tuple[dict, list]:
    """Add the requests one step apart (the first decodes when the rest arrive) and step to the end;
    returns their tokens and per step: (whether it held a decode, soft tokens encoded, inputs encoded)."""
    steps, outputs = [], {}
    pending = list(prompts.items())
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in engine.scheduler.running)
        calls = len(engine.encoder.calls)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        new = engine.encoder.calls[calls:]
        steps.append((decoding, sum(c.num_tokens for c in new), sum(c.num_inputs for c in new)))
    return outputs, steps


def test_videos_split_beside_decodes_give_the_same_tokens(tiny_model_dir):
    prompts = {"text": _user("savings loan branch payment"), "video": _video(3, 6), "video2": _video(4, 5)}
    want, whole = _step_all(make_engine(tiny_model_dir), prompts)
    engine = make_engine(tiny_model_dir, max_encoder_tokens_beside_decodes=1)
    got, split = _step_all(engine, prompts)
    assert got == want
    # beside decodes one frame a step (a frame's soft tokens exceed the cap of 1); whole videos without
    assert max(inputs for _, _, inputs in whole) >= 5
    assert all(inputs <= 1 for decoding, _, inputs in split if decoding)
    assert sum(inputs for _, _, inputs in split) == sum(inputs for _, _, inputs in whole) == 11
    assert engine.encoder_cache.num_partial == 0 and not engine.encoder_cache._refs
    assert_pools_free(engine)


def test_the_cap_bounds_the_soft_tokens_encoded_beside_decodes(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    per_frame = engine.process_prompt(_video(3, 6)).mm_items[0].spans[0]
    frame_tokens = per_frame[1] - per_frame[0]
    cap = 2 * frame_tokens + frame_tokens // 2  # two frames fit, not three
    engine = make_engine(tiny_model_dir, max_encoder_tokens_beside_decodes=cap)
    image = {"prompt": _user("<|image|>What is it?"), "multi_modal_data": {"image": _image(1)}}
    prompts = {"text": _user("balance transfer card"), "video": _video(3, 6), "image": image}
    want, _ = _step_all(make_engine(tiny_model_dir), prompts)
    got, steps = _step_all(engine, prompts)
    assert got == want
    beside = [(tokens, inputs) for decoding, tokens, inputs in steps if decoding and tokens]
    assert beside and all(tokens <= cap or inputs == 1 for tokens, inputs in beside)
    assert any(inputs == 2 for _, inputs in beside)  # two frames of the video in a step
    assert_pools_free(engine)


def _video_beside_a_decode(model_dir, seed: int):
    """An engine encoding one frame a step beside decodes, a text request decoding, a video just added."""
    engine = make_engine(model_dir, max_encoder_tokens_beside_decodes=1)
    engine.add_request(engine.make_request("text", engine.process_prompt(_user("hello there")), GREEDY))
    engine.step()
    engine.add_request(engine.make_request("video", engine.process_prompt(_video(seed, 6)), GREEDY))
    return engine


def test_the_prefill_follows_the_frames_already_encoded(tiny_model_dir):
    engine = _video_beside_a_decode(tiny_model_dir, 5)
    video = engine.requests["video"]
    item = video.mm_items[0]
    seen = []
    while (
        engine.encoder_cache.frames_done(item.content_hash) or item.content_hash not in engine.encoder_cache
    ):
        engine.step()
        done = engine.encoder_cache.frames_done(item.content_hash)
        if done:  # never past the frames encoded, and never inside a frame
            assert video.num_computed_tokens <= item.spans[done - 1][1]
            seen.append((done, video.num_computed_tokens))
    assert [d for d, _ in seen] == [1, 2, 3, 4, 5]
    assert any(computed > item.offset for _, computed in seen)  # frames prefilled before the last encoded
    engine.run_until_finished()
    assert_pools_free(engine)


def test_an_abort_mid_video_drops_its_frames(tiny_model_dir):
    engine = _video_beside_a_decode(tiny_model_dir, 6)
    engine.step()
    engine.step()
    assert engine.encoder_cache.num_partial == 1
    engine.abort_request("video")
    assert engine.encoder_cache.num_partial == 0
    engine.run_until_finished()
    assert not engine.encoder_cache._refs
    assert_pools_free(engine)


def test_the_cap_is_checked():
    with pytest.raises(ValueError, match="max_encoder_tokens_beside_decodes: must be positive"):
        EngineConfig(max_encoder_tokens_beside_decodes=0)
    with pytest.raises(ValueError, match="pick one"):
        EngineConfig(max_encoder_tokens_beside_decodes=64, overlap_encoder=True)


def test_mixed_workload_with_both_caps_matches(tiny_model_dir):
    """Prompts, images, videos and audio with both caps beside decodes and async scheduling: the tokens of
    the uncapped engine, every pin and block returned."""
    prompts = mixed_prompts()
    base = make_engine(tiny_model_dir)
    engine = make_engine(
        tiny_model_dir,
        max_encoder_tokens_beside_decodes=8,
        max_prefill_tokens_beside_decodes=16,
        async_scheduling=True,
    )
    results = []
    for e in (base, engine):
        for i, prompt in enumerate(prompts):
            e.add_request(e.make_request(str(i), e.process_prompt(prompt), GREEDY))
        results.append({rid: o.outputs[0].token_ids for rid, o in e.run_until_finished().items()})
    assert results[0] == results[1]
    assert engine.encoder_cache.num_partial == 0 and not engine.encoder_cache._refs
    assert_pools_free(engine)
