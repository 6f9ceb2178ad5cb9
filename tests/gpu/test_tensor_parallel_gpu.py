"""Tensor parallel's code path on one GPU: both ranks on the same device over gloo
(``G4SERVE_TP_ONE_DEVICE=1``, eager steps), so the Triton kernels run on a rank's sharded shapes (half the
query heads, the KV heads a rank holds, half the MLP units) and the vocab-parallel embeddings and LM head
run on CUDA tensors. Real multi-GPU runs (NCCL, CUDA graphs across ranks) need a multi-GPU machine."""

from __future__ import annotations

import pytest

from g4serve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Hello there, how are"]


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    monkeypatch.setenv("G4SERVE_TP_ONE_DEVICE", "1")


def _outputs(llm: LLM, params: SamplingParams):
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("variant", ["e", "31b"])
def test_fp32_tokens_equal_one_rank(hf_checkpoint, variant):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    engine = dict(device="cuda", dtype="float32", enforce_eager=True, text_only=True, kv_cache_bytes=64 << 20)
    with LLM(hf_checkpoint(variant), **engine) as one:
        want = _outputs(one, params)
    with LLM(hf_checkpoint(variant), tensor_parallel_size=2, **engine) as split:
        got = _outputs(split, params)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for position, expected in zip(logprobs, want_logprobs, strict=True):
            for token, value in expected.items():
                assert position[token].logprob == pytest.approx(value.logprob, abs=1e-3)


def test_e4b_bf16_first_token_distribution_close_to_one_rank():
    """Full-size shapes (E4B, bf16, random weights): the first token's top-5 log-probabilities agree with one
    rank's to bf16 noise (the partial sums are rounded in a different order)."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    engine = dict(
        device="cuda", enforce_eager=True, text_only=True, kv_cache_bytes=2 << 30, max_model_len=512
    )
    with LLM("e4b", **engine) as one:
        want = _outputs(one, params)
    with LLM("e4b", tensor_parallel_size=2, **engine) as split:
        got = _outputs(split, params)
    for (_, (position,)), (_, (expected,)) in zip(got, want, strict=True):
        shared = position.keys() & expected.keys()
        assert len(shared) >= 3
        for token in shared:
            assert position[token].logprob == pytest.approx(expected[token].logprob, abs=0.1)


two_gpus = pytest.mark.skipif(
    not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
    reason="NCCL across two GPUs",
)


@two_gpus
def test_nccl_with_cuda_graphs_stops_and_starts_again(hf_checkpoint, monkeypatch):
    """Two GPUs, NCCL, decode graphs that captured its all-reduces: the engine stops within seconds (the
    communicators are destroyed by both ranks together, after the graphs are freed), and a second engine
    starts in the same process with the same tokens."""
    import time

    monkeypatch.delenv("G4SERVE_TP_ONE_DEVICE")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Few graphs to capture (decode batches up to 4, chunks up to 128 tokens): two start-ups stay well inside
    # a minute (the defaults capture 19 graphs per start, ~30 s on an H200 pair).
    engine = dict(
        device="cuda",
        dtype="float32",
        text_only=True,
        kv_cache_bytes=64 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    )
    runs = []
    for _ in range(2):
        llm = LLM(hf_checkpoint("31b"), tensor_parallel_size=2, **engine)
        assert llm.engine.runner.decode_graphs is not None
        runs.append([tokens for tokens, _ in _outputs(llm, params)])
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 10.0
    assert runs[0] == runs[1]
