"""An adapter's greedy tokens equal those of PEFT's merged-weights model, alone and in batches that mix
adapters (and requests without one), through chunked prefill, the prefix cache and preemption."""

from __future__ import annotations

import pytest

from g4serve import LLM, LoRARequest, SamplingParams

PROMPTS = [  # ids past the tiny tokenizer's special and media placeholder tokens (< 20)
    [25, 77, 300, 41, 29, 18 + 20, 222, 64, 97, 400, 23, 58, 130, 71, 55, 610, 32, 39, 45, 88],
    [31, 28, 900, 212, 77, 35],
    [117, 47, 350, 42, 600, 101, 27, 33, 812, 99, 90, 24, 205],
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", text_only=True, kv_cache_bytes=16 << 20, max_num_batched_tokens=64)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _run(llm: LLM, prompts, lora_request=None) -> list[list[int]]:
    return _tokens(
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora_request)
    )


@pytest.fixture(scope="module")
def expected(lora_adapter):
    """Greedy tokens of each merged checkpoint and of the base model, on PROMPTS."""
    out = {}
    for name in ("all", "qv", "mlp"):
        base, _, merged = lora_adapter(name)
        out[name] = _run(LLM(merged, **ENGINE), PROMPTS)
    out[None] = _run(LLM(base, **ENGINE), PROMPTS)
    return out


@pytest.fixture(scope="module")
def served(lora_adapter):
    """One engine on the base checkpoint with three adapters loaded at start."""
    base = lora_adapter("all")[0]
    modules = {name: str(lora_adapter(name)[1]) for name in ("all", "qv", "mlp")}
    return LLM(base, enable_lora=True, max_loras=4, max_lora_rank=8, lora_modules=modules, **ENGINE)


@pytest.mark.parametrize("name", ["all", "qv", "mlp"])
def test_adapter_equals_its_merged_model(served, expected, name):
    assert expected[name] != expected[None], "the adapter must change the greedy tokens to test anything"
    assert _run(served, PROMPTS, LoRARequest(name)) == expected[name]


def test_one_batch_mixes_adapters_and_the_base_model(served, expected):
    names = ["all", None, "qv", "mlp", "all", None]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    got = _run(served, prompts, [LoRARequest(n) if n else None for n in names])
    assert got == [expected[n][i % 3] for i, n in enumerate(names)]


def test_prefix_cache_keeps_adapters_apart(served, expected):
    """The base model's cached blocks of a prompt are not reused for an adapter (its K/V differ), but the
    adapter's own blocks are."""
    prompt = {"prompt_token_ids": PROMPTS[0][::-1] * 2}  # no other test has run it
    served.generate([prompt], GREEDY)
    first = served.generate([prompt], GREEDY, lora_request=LoRARequest("all"))[0]
    again = served.generate([prompt], GREEDY, lora_request=LoRARequest("all"))[0]
    other = served.generate([prompt], GREEDY, lora_request=LoRARequest("qv"))[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_salt_and_an_adapter_both_keep_blocks_apart(served):
    """An adapter's blocks under a client's cache_salt are shared only with the same adapter and salt."""
    tokens = PROMPTS[2][::-1] * 3  # no other test has run it

    def run(salt, name):
        prompt = {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}
        return served.generate([prompt], GREEDY, lora_request=LoRARequest(name) if name else None)[0]

    assert run("a", "all").num_cached_tokens == 0
    assert run("a", "all").num_cached_tokens > 0
    assert run(None, "all").num_cached_tokens == 0
    assert run("a", None).num_cached_tokens == 0
    assert run("a", "qv").num_cached_tokens == 0
    assert run("b", "all").num_cached_tokens == 0


def test_adapter_without_v_proj_on_k_eq_v_layers(lora_adapter):
    """26B-A4B / 31B: full layers take V from K, so PEFT makes no v_proj adapter there (sglang#28199)."""
    from safetensors import safe_open

    base, adapter, merged = lora_adapter("moe")
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".2.self_attn.k_proj." in k for k in keys) and not any(
        ".2.self_attn.v_proj." in k for k in keys
    )
    assert any(".0.self_attn.v_proj." in k for k in keys)
    want = _run(LLM(merged, **ENGINE), PROMPTS)
    llm = LLM(base, enable_lora=True, max_lora_rank=4, **ENGINE)
    assert want != _run(llm, PROMPTS)
    assert _run(llm, PROMPTS, LoRARequest("moe", 1, str(adapter))) == want


def test_preempted_adapter_requests_recompute_with_their_adapter(lora_adapter, expected):
    """A KV cache too small for every sequence at once: requests are preempted and recomputed."""
    base = lora_adapter("all")[0]
    llm = LLM(
        base,
        enable_lora=True,
        max_lora_rank=8,
        lora_modules={"all": str(lora_adapter("all")[1]), "qv": str(lora_adapter("qv")[1])},
        **{**ENGINE, "kv_cache_bytes": 160 << 10, "block_size": 4},
    )
    names = ["all", "qv", None] * 2
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    got = _run(llm, prompts, [LoRARequest(n) if n else None for n in names])
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == [expected[n][i % 3] for i, n in enumerate(names)]
