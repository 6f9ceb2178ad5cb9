"""Tensor parallel on the CPU: N processes over gloo serve transformers-written tiny checkpoints of each
architecture, and their greedy tokens and log-probabilities equal one process's (fp32; the partial sums add
in a different order, so log-probabilities agree to rounding). Also: prefix-cache hits, chunked prefill and
preemption (all rank 0's bookkeeping, the workers only see block tables), image prompts (encoded on rank 0,
the soft tokens broadcast), and the workers' exit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from g4serve import LLM, SamplingParams

pytestmark = pytest.mark.distributed

ENGINE = dict(device="cpu", kv_cache_bytes=8 << 20)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog and then",
    "Hello there, how are",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=4)
USER_IMAGE = "<|turn>user\n<|image|>What is in the picture?<turn|>\n<|turn>model\n"


def _run(llm: LLM, prompts, params=GREEDY) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(prompts, params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for position, expected in zip(logprobs, want_logprobs, strict=True):
            assert position.keys() == expected.keys()
            for token, value in expected.items():
                assert position[token].logprob == pytest.approx(value.logprob, abs=2e-4)


@pytest.mark.parametrize(
    "variant, size, ep",
    [
        ("e", 2, False),  # per-layer embeddings (vocab-split), KV-shared layers, fast prefill
        ("e", 4, False),  # 2 KV heads over 4 ranks: each KV head held by two ranks
        ("moe", 2, False),  # routed experts split by their units; one global KV head on both ranks
        ("moe", 2, True),  # expert parallel: two whole experts per rank
        ("31b", 4, False),  # K=V global layers with 1 KV head over 4 ranks
    ],
)
def test_greedy_tokens_and_logprobs_equal_one_rank(hf_checkpoint, variant, size, ep):
    path = hf_checkpoint(variant)
    with LLM(path, text_only=True, **ENGINE) as one:
        want = _run(one, PROMPTS)
    tp = dict(tensor_parallel_size=size, enable_expert_parallel=ep)
    with LLM(path, text_only=True, **tp, **ENGINE) as split:
        assert split.engine.model.cfg.text.num_attention_heads == 4 // size  # rank 0 holds its share
        _assert_same(_run(split, PROMPTS), want)
        processes = split.engine.tp_workers.processes
    assert not any(p.is_alive() for p in processes)  # shut down with the LLM


def test_prefix_hits_chunked_prefill_and_preemption(hf_checkpoint):
    """Rank 0 alone decides where tokens go: chunks of 16 tokens, a cache small enough to preempt, prefix
    hits on a repeated prompt; the workers follow the block tables they are sent."""
    path = hf_checkpoint("e")
    engine = dict(ENGINE, kv_cache_bytes=160 << 10, block_size=4, max_num_batched_tokens=16, text_only=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(path, **engine) as one:
        want = _run(one, PROMPTS * 2, params)
        one_capacity = one.engine.kv.capacity_tokens()
    # a rank holds half the KV heads: half the bytes make the same blocks
    with LLM(path, tensor_parallel_size=2, **dict(engine, kv_cache_bytes=80 << 10)) as split:
        assert split.engine.kv.capacity_tokens() == one_capacity
        got = _run(split, PROMPTS * 2, params)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert split.engine.scheduler.num_preemptions > 0
        # a prompt that extends an earlier request's prompt and output hits their blocks
        first = split.generate([PROMPTS[2]], params)[0]
        ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids[:12])
        four = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        again = split.generate([{"prompt_token_ids": ids}], four)[0]
        assert again.num_cached_tokens >= 32
        assert list(again.outputs[0].token_ids) == want[2][0][12:16]
        assert all(p.num_free == p.num_blocks for p in split.engine.kv.pools.values())


def test_fp8_kv_cache_with_per_head_scales(hf_checkpoint, tmp_path):
    """An FP8 cache at 2 ranks: each rank stores its KV heads with those heads' checkpoint scales. Layer 0's
    head 1 (rank 1's) gets a K scale that saturates it at +-448 * 0.002; read with head 0's scale instead,
    every prompt's first token changes. Compared on the first token, its log-probability to 0.1: the ranks'
    K/V differ from one rank's by fp32 rounding, which now and then moves a value to the next e4m3 step (1/8
    of its octave; measured: up to 0.03 in a log-probability), and over several decode steps of a
    random-weight model (near-flat distributions) such steps can flip a token."""
    import shutil

    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    shutil.copytree(hf_checkpoint("e"), scaled)
    (weights,) = scaled.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.language_model.layers.0.self_attn.k_scale"] = torch.tensor([0.5, 0.002])
    tensors["model.language_model.layers.0.self_attn.v_scale"] = torch.tensor([0.25, 1.5])
    save_file(tensors, weights, metadata={"format": "pt"})
    engine = dict(ENGINE, text_only=True, kv_cache_dtype="fp8")
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    with LLM(scaled, **engine) as one:
        want = _run(one, PROMPTS, first)
    with LLM(scaled, tensor_parallel_size=2, **engine) as split:
        torch.testing.assert_close(split.engine.kv_cache.scales[0], torch.tensor([[0.5], [0.25]]))
        got = _run(split, PROMPTS, first)
    for ((token,), (position,)), ((want_token,), (expected,)) in zip(got, want, strict=True):
        assert token == want_token
        assert position[token].logprob == pytest.approx(expected[token].logprob, abs=0.1)


def test_image_prompt(hf_checkpoint):
    """The vision tower runs on rank 0; its soft tokens reach the other ranks with the step's inputs."""
    path = hf_checkpoint("31b")
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (40, 56, 3), np.uint8)
    prompt = {"prompt": USER_IMAGE, "multi_modal_data": {"image": image}}
    with LLM(path, **ENGINE) as one:
        want = _run(one, [prompt])
    with LLM(path, tensor_parallel_size=2, **ENGINE) as split:
        assert split.engine.model.vision_tower is not None
        _assert_same(_run(split, [prompt]), want)


def test_a_worker_that_cannot_load_fails_the_start_with_its_error(hf_checkpoint, tmp_path):
    """Rank 0 reads the config and refuses what cannot split before starting anyone; a checkpoint that
    fails in a worker (here a tensor of the wrong shape) fails the engine's start with that rank's error."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(hf_checkpoint("31b"), broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.0.mlp.down_proj.weight"))
    tensors[name] = tensors[name][:, :-2].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(Exception, match="down_proj.weight has shape"):
        LLM(broken, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 ranks cannot split 4 query heads"):
        LLM(hf_checkpoint("31b"), tensor_parallel_size=3, **ENGINE)


def test_async_scheduling_reads_rank_zeros_samples_on_every_rank(hf_checkpoint):
    """With async scheduling (the default) a decode's input token is the previous step's sample, still on
    rank 0's device when the step is launched: rank 0 broadcasts its samples, every rank copies them into its
    input ids. Steps overlapped, and the tokens equal a synchronous single rank's."""
    path = hf_checkpoint("e")
    with LLM(path, text_only=True, async_scheduling=False, **ENGINE) as one:
        want = _run(one, PROMPTS)
    with LLM(path, text_only=True, tensor_parallel_size=2, **ENGINE) as split:
        assert split.engine.config.async_scheduling
        _assert_same(_run(split, PROMPTS), want)
        assert split.engine.num_overlapped_steps > 0


@pytest.mark.parametrize("variant, ep", [("31b", False), ("moe", True)])
def test_quantized_at_load(hf_checkpoint, variant, ep):
    """--quantization w4a16-g32 on a bf16-style checkpoint at 2 ranks: each rank quantizes its slice of every
    projection. Where every int4 group (32 columns) lies inside a rank's slice, its weights are the
    single-GPU model's slices, and the tokens and log-probabilities equal one rank's: the 31B-like decoder,
    and the MoE one with whole experts per rank (split by units, the tiny experts' 16 columns per rank would
    cut their 32-column groups, and each rank's group scale would be its own)."""
    path = hf_checkpoint(variant)
    engine = dict(ENGINE, text_only=True, quantization="w4a16-g32")
    with LLM(path, **engine) as one:
        want = _run(one, PROMPTS)
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=ep, **engine) as split:
        _assert_same(_run(split, PROMPTS), want)
