"""The offline API (``from g4serve import LLM, SamplingParams``) on the tiny model, CPU fp32: prompt forms,
chat, sampling-parameter validation, determinism and seeds, n, stop conditions, logprobs and min_tokens.

Outputs of a random tiny model are noise, so expectations are derived from a first greedy run or from the
model's own logits, never hard-coded."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from g4serve import LLM, SamplingParams
from g4serve.config import FULL, SLIDING
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.layers.attention import TorchAttention, contiguous_metadata
from g4serve.models.gemma4.loader import CheckpointError
from g4serve.outputs import CompletionOutput, RequestOutput
from g4serve.processing.tokenizer import IncrementalDetokenizer
from g4serve.sampling_params import SamplingParamsError

PROMPTS = [
    "The bank opened a new savings account",
    "Hello there, my friend",
    "It was a bright, cold day in April",
]
USER_IMAGE = "<|turn>user\n<|image|>What is in the picture?<turn|>\n<|turn>model\n"
EOS = 1  # <eos> of the tiny tokenizer; <turn|> (6) is the other EOS id


def _engine_kwargs() -> dict:
    return {"device": "cpu", "dtype": "float32", "kv_cache_bytes": 16 << 20, "max_num_batched_tokens": 512}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), **_engine_kwargs())


def _greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8))


@torch.inference_mode()
def _first_step_logprobs(llm: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits after the whole prompt, from one plain forward (no engine)."""
    model = llm.model
    cfg = model.cfg.text
    block = 16
    blocks = -(-len(prompt_ids) // block)
    cache = PagedKVCache(cfg, {SLIDING: blocks, FULL: blocks}, block, torch.float32, "cpu")
    table = list(range(blocks))
    meta = contiguous_metadata([0], [len(prompt_ids)], {SLIDING: [table], FULL: [table]}, block, "cpu", [[]])
    hidden = model(torch.tensor(prompt_ids), meta, TorchAttention(cfg, cache))
    return torch.log_softmax(model.compute_logits(hidden[-1:]).float(), dim=-1)[0]


# ---- prompt forms --------------------------------------------------------------------------------------


def test_string_prompt_and_token_ids_prompt_agree(llm):
    out = llm.generate(PROMPTS[0], _greedy(8))
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], RequestOutput)
    res = out[0]
    assert res.prompt == PROMPTS[0] and res.finished
    # One BOS from tokenizer.json's post-processor, then the text.
    bos = llm.tokenizer.bos_token_id
    assert res.prompt_token_ids == [bos] + llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    completion = res.outputs[0]
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    by_ids = llm.generate({"prompt_token_ids": res.prompt_token_ids}, _greedy(8))[0]
    assert by_ids.prompt is None and by_ids.prompt_token_ids == res.prompt_token_ids
    assert by_ids.outputs[0].token_ids == completion.token_ids


def test_greedy_is_deterministic_and_batch_independent(llm):
    alone = [llm.generate(p, _greedy(12))[0].outputs[0].token_ids for p in PROMPTS]
    again = [llm.generate(p, _greedy(12))[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(12))]
    assert alone == again == batched
    assert len({tuple(t) for t in alone}) == 3  # different prompts, different continuations
    # Outputs come back in prompt order whatever order requests finish in.
    mixed = llm.generate(PROMPTS, [_greedy(12), _greedy(3), _greedy(7)])
    assert [o.outputs[0].token_ids for o in mixed] == [alone[0], alone[1][:3], alone[2][:7]]
    assert [o.prompt for o in mixed] == PROMPTS


def test_multimodal_prompt(llm):
    cfg = llm.config
    out = llm.generate({"prompt": USER_IMAGE, "multi_modal_data": {"image": _image(0)}}, _greedy(8))[0]
    ids = out.prompt_token_ids
    # The one <|image|> placeholder became <|image> + soft tokens + <image|>.
    n_soft = ids.count(cfg.image_token_id)
    assert n_soft > 1
    first = ids.index(cfg.image_token_id)
    assert ids[first - 1] == cfg.boi_token_id
    assert ids[first : first + n_soft] == [cfg.image_token_id] * n_soft
    assert ids[first + n_soft] == cfg.eoi_token_id
    # The same pixels as an array or as PNG bytes give the same tokens; other pixels give others.
    png = io.BytesIO()
    _image(0).save(png, format="PNG")
    same = llm.generate(
        [
            {"prompt": USER_IMAGE, "multi_modal_data": {"image": np.asarray(_image(0))}},
            {"prompt": USER_IMAGE, "multi_modal_data": {"image": png.getvalue()}},
            {"prompt": USER_IMAGE, "multi_modal_data": {"image": _image(1)}},
        ],
        _greedy(8),
    )
    assert same[0].outputs[0].token_ids == same[1].outputs[0].token_ids == out.outputs[0].token_ids
    assert same[2].outputs[0].token_ids != out.outputs[0].token_ids  # the image reaches the decoder


def test_prompt_errors_name_the_field_and_leave_no_work(llm):
    vocab = llm.config.text.vocab_size
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [2, vocab]}], _greedy(4))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="multi_modal_data.image"):
        llm.generate(
            {"prompt": USER_IMAGE + "<|image|>", "multi_modal_data": {"image": _image(0)}}, _greedy(4)
        )
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"smell": b"x"}}, _greedy(4))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": []}, _greedy(4))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS, [_greedy(4)])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPTS[0], _greedy(llm.engine.max_model_len))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([], _greedy(4)) == []


def test_bad_model_path_or_device_names_the_option(tmp_path, tiny_model_dir):
    with pytest.raises(
        CheckpointError, match="model: .*does-not-exist.* neither a checkpoint directory nor a preset"
    ):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")
    with pytest.raises(ValueError, match="device: 'gpu0' is not a torch device"):
        LLM(str(tiny_model_dir), device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' was requested but CUDA is not available"):
            LLM(str(tiny_model_dir), device="cuda")


# ---- chat ------------------------------------------------------------------------------------------------


def test_chat_text(llm):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is my balance?"},
    ]
    out = llm.chat(messages, _greedy(6))[0]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.startswith("<bos>") and rendered.endswith("<|turn>model\n")
    ids = out.prompt_token_ids
    assert ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    bos = llm.tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1  # the template's <bos>, not a second one
    assert (
        out.outputs[0].token_ids
        == llm.generate({"prompt_token_ids": ids}, _greedy(6))[0].outputs[0].token_ids
    )
    # A list of conversations gives one output per conversation.
    two = llm.chat([messages, [{"role": "user", "content": "Hi"}]], _greedy(6))
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert two[1].prompt_token_ids != ids
    for bad in ([], [[]]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, _greedy(2))
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        llm.chat([{"role": "wizard", "content": "hi"}], _greedy(2))


def test_chat_with_an_image_part(llm):
    image = _image(0)
    out = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
        _greedy(8),
    )[0]
    # Same prompt and same tokens as the hand-written template with the image placeholder.
    direct = llm.generate({"prompt": USER_IMAGE, "multi_modal_data": {"image": image}}, _greedy(8))[0]
    assert out.prompt_token_ids == direct.prompt_token_ids
    assert out.prompt_token_ids.count(llm.config.image_token_id) > 1
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


# ---- SamplingParams ------------------------------------------------------------------------------------

BAD_PARAMS = [
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"seed": "42"}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"stop_token_ids": 1}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
]


@pytest.mark.parametrize("kwargs,name", BAD_PARAMS, ids=[repr(k)[:40] for k, _ in BAD_PARAMS])
def test_sampling_params_errors_name_the_parameter(kwargs, name):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(f"{name}: ")
    assert isinstance(err.value, ValueError)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, p.logprobs) == (
        1,
        1.0,
        1.0,
        0,
        16,
        0,
        None,
    )
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    q = SamplingParams(
        temperature=0, top_k=-1, stop="END", stop_token_ids=(7,), max_tokens=None, min_tokens=3
    )
    assert (
        q.greedy and q.top_k == 0 and q.stop == ["END"] and q.stop_token_ids == [7] and q.max_tokens is None
    )


# ---- seeds and n -------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10)
    alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    assert llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids == alone
    others = [
        SamplingParams(temperature=1.0, max_tokens=14),  # unseeded: draws from the global generator
        SamplingParams(temperature=1.0, seed=1234, max_tokens=3),  # same seed, other prompt
        _greedy(5),
    ]
    batch = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[0]], others + [seeded])
    assert batch[3].outputs[0].token_ids == alone
    other_seed = (
        llm.generate(
            PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=10)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_n_returns_n_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    out = llm.generate(PROMPTS[1], params)
    assert len(out) == 1
    completions = out[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) == 3  # independent samples
    again = llm.generate(PROMPTS[1], params)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]
    # Greedy n=2: two identical completions; one RequestOutput per prompt, in prompt order.
    both = llm.generate(PROMPTS[:2], SamplingParams(n=2, temperature=0, max_tokens=5))
    assert len(both) == 2 and both[0].request_id != both[1].request_id
    greedy = [llm.generate(p, _greedy(5))[0].outputs[0].token_ids for p in PROMPTS[:2]]
    for res, expected in zip(both, greedy):
        assert [c.token_ids for c in res.outputs] == [expected, expected]


# ---- stop conditions ---------------------------------------------------------------------------------------


def _prefix_texts(llm: LLM, token_ids: list[int]) -> list[str]:
    """The text known to be final after each number of tokens. The streaming detokenizer holds back
    byte-fallback runs (a later byte can still turn them into U+FFFD), so a stop string inside one is seen
    only when the run ends."""
    detok = IncrementalDetokenizer(llm.tokenizer, skip_special_tokens=True)
    texts = [""]
    for token in token_ids:
        texts.append(texts[-1] + detok.add(token))
    return texts


def _find_stop(texts: list[str], across_tokens: bool) -> tuple[str, int, int]:
    """A two-character ASCII stop string first occurring at ``pos`` of the final text, completed by token
    ``k``."""
    final = texts[-1]
    boundaries = {len(t) for t in texts}
    for pos in range(1, len(final) - 1):
        stop = final[pos : pos + 2]
        if not (stop.isascii() and stop.isalnum()) or final.find(stop) != pos:
            continue
        if across_tokens != (pos + 1 in boundaries):
            continue
        k = next(k for k, t in enumerate(texts) if stop in t)
        return stop, pos, k
    raise AssertionError(f"no suitable stop string in {final!r}")


@pytest.mark.parametrize("across_tokens", [False, True])
def test_stop_strings_cut_the_text(llm, across_tokens):
    found = None
    for prompt in PROMPTS:
        ref = llm.generate(prompt, _greedy(40))[0].outputs[0]
        try:
            found = prompt, ref, _find_stop(_prefix_texts(llm, ref.token_ids), across_tokens)
            break
        except AssertionError:
            continue
    assert found is not None, "the tiny model produced no usable text for a stop string"
    prompt, ref, (stop, pos, k) = found
    text = ref.text
    assert text.startswith(_prefix_texts(llm, ref.token_ids)[-1])
    out = llm.generate(prompt, _greedy(40, stop=[stop, "never-appears"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:pos]
    assert out.token_ids == ref.token_ids[:k]  # generation stopped at the token completing the stop string
    kept = llm.generate(prompt, _greedy(40, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: pos + len(stop)] and kept.finish_reason == "stop"
    assert kept.token_ids == out.token_ids


def test_stop_token_ids_and_max_tokens(llm):
    ref = llm.generate(PROMPTS[0], _greedy(20))[0].outputs[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 20 and ref.stop_reason is None
    # Stop on the first token that does not occur earlier in the output.
    k = next(i for i in range(3, 20) if ref.token_ids[i] not in ref.token_ids[:i])
    stop_id = ref.token_ids[k]
    out = llm.generate(PROMPTS[0], _greedy(20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == ref.token_ids[: k + 1]  # the stop token is kept in token_ids ...
    assert out.text == llm.tokenizer.decode(
        ref.token_ids[:k], skip_special_tokens=True
    )  # ... but not in text
    short = llm.generate(PROMPTS[0], _greedy(5))[0].outputs[0]
    assert short.finish_reason == "length" and short.token_ids == ref.token_ids[:5]


@pytest.fixture(scope="module")
def eos_llm(tiny_model_dir) -> tuple[LLM, str]:
    """The tiny model with its tied <eos> embedding row made the greedy choice right after PROMPTS[0]."""
    model_llm = LLM(str(tiny_model_dir), **_engine_kwargs())
    first = model_llm.generate(PROMPTS[0], _greedy(1))[0].outputs[0].token_ids[0]
    emb = model_llm.model.language_model.embed_tokens.weight
    with torch.no_grad():
        emb[EOS] = 3.0 * emb[first]  # logit(eos) = 3 x logit(first) > logit(first) > every other logit
    assert model_llm.generate(PROMPTS[0], _greedy(1, ignore_eos=True))[0].outputs[0].token_ids == [EOS]
    return model_llm, PROMPTS[0]


def test_eos_stops_unless_ignored(eos_llm):
    model_llm, prompt = eos_llm
    out = model_llm.generate(prompt, _greedy(8))[0].outputs[0]
    assert (
        out.token_ids == [EOS] and out.finish_reason == "stop" and out.stop_reason == EOS and out.text == ""
    )
    ignored = model_llm.generate(prompt, _greedy(4, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids[0] == EOS and len(ignored.token_ids) == 4 and ignored.finish_reason == "length"


def test_min_tokens_delays_the_stop(eos_llm):
    model_llm, prompt = eos_llm
    out = model_llm.generate(prompt, _greedy(8, min_tokens=3))[0].outputs[0]
    assert len(out.token_ids) >= 3
    assert out.finish_reason == "length" or out.token_ids[-1] in model_llm.config.text.eos_token_ids


def test_min_tokens_suppresses_eos(eos_llm):
    """vLLM semantics: before min_tokens tokens exist, EOS and stop_token_ids cannot be generated at all."""
    model_llm, prompt = eos_llm
    eos_ids = set(model_llm.config.text.eos_token_ids)
    out = model_llm.generate(prompt, _greedy(8, min_tokens=3))[0].outputs[0]
    assert not eos_ids & set(out.token_ids[:3]), out.token_ids
    stop_id = model_llm.generate(prompt, _greedy(1, ignore_eos=True))[0].outputs[0].token_ids[0]
    out = model_llm.generate(prompt, _greedy(8, min_tokens=2, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert stop_id not in out.outputs[0].token_ids[:2]


# ---- logprobs ----------------------------------------------------------------------------------------------


def test_logprobs_match_a_manual_log_softmax(llm):
    res = llm.generate(PROMPTS[2], _greedy(4, logprobs=5))[0]
    completion = res.outputs[0]
    assert len(completion.logprobs) == 4
    expected = _first_step_logprobs(llm, res.prompt_token_ids)
    top_vals, top_ids = expected.topk(5)
    step0 = completion.logprobs[0]
    chosen = completion.token_ids[0]
    assert chosen == int(top_ids[0])  # greedy picks the argmax
    assert set(step0) == set(top_ids.tolist())
    for rank, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
        assert step0[tid].rank == rank
        assert step0[tid].logprob == pytest.approx(val, abs=1e-4)
        assert step0[tid].decoded_token == llm.tokenizer.decode([tid])
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and entry[token].rank == 1 and len(entry) == 5
        assert entry[token].logprob <= 0
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in ranked] == sorted((lp.logprob for lp in ranked), reverse=True)
    total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_logprobs_zero_none_and_sampled(llm):
    only = llm.generate(PROMPTS[2], _greedy(3, logprobs=0))[0].outputs[0]
    assert [list(e) for e in only.logprobs] == [[t] for t in only.token_ids]
    none = llm.generate(PROMPTS[2], _greedy(3))[0].outputs[0]
    assert none.logprobs is None and none.cumulative_logprob is None
    # Sampled tokens report their logprob under the unmodified distribution (not the temperature-scaled one).
    res = llm.generate(PROMPTS[2], SamplingParams(temperature=1.5, seed=3, max_tokens=1, logprobs=2))[0]
    token = res.outputs[0].token_ids[0]
    expected = _first_step_logprobs(llm, res.prompt_token_ids)
    assert res.outputs[0].logprobs[0][token].logprob == pytest.approx(float(expected[token]), abs=1e-4)


def test_prompt_and_token_ids_together_are_refused(llm):
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt": "hi", "prompt_token_ids": [2, 5, 6]}, _greedy(2))


def test_the_engine_resolves_the_token_budget_for_its_device(tiny_model_dir):
    """No budget given: the engine takes its device's default (CPU: 2,048) and its scheduler steps under
    it."""
    kwargs = {k: v for k, v in _engine_kwargs().items() if k != "max_num_batched_tokens"}
    with LLM(str(tiny_model_dir), **kwargs) as llm:
        assert llm.engine.config.max_num_batched_tokens == 2048
        assert llm.engine.scheduler.config.max_num_batched_tokens == 2048
        assert llm.generate(PROMPTS[0], _greedy(4))[0].outputs[0].token_ids
