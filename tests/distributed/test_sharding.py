"""How the decoder splits over tensor-parallel ranks, checked without starting any process: the rank-local
config, the slices each rank takes of every tensor (together they are the whole), the KV heads ranks share
when there are fewer KV heads than ranks, and what is refused before any worker starts."""

from __future__ import annotations

import pytest
import torch

from g4serve.config import TextConfig
from g4serve.distributed.sharding import (
    ShardPlan,
    check_tensor_parallel,
    rank_kv_heads,
    shard_text_config,
)
from g4serve.engine.config import EngineConfig
from g4serve.models.gemma4.loader import build_model, init_random_weights, model_config
from g4serve.tiny import tiny_config


def _text(variant: str) -> TextConfig:
    return tiny_config(variant).text


def test_rank_config_splits_heads_and_units():
    text = _text("moe")  # 4 query heads, 2 sliding KV heads, 1 global KV head, experts of width 32
    local = shard_text_config(text, 2)
    assert local.num_attention_heads == 2
    assert local.intermediate_size == text.intermediate_size // 2
    assert local.moe_intermediate_size == 16
    sliding, full = local.layer_types.index("sliding_attention"), local.layer_types.index("full_attention")
    assert local.layer_num_kv_heads(sliding) == 1
    assert local.layer_num_kv_heads(full) == 1  # one global KV head, held by both ranks
    assert (local.vocab_size, local.head_dim, local.global_head_dim) == (
        text.vocab_size,
        text.head_dim,
        text.global_head_dim,
    )
    assert shard_text_config(text, 1) is text


def test_fewer_kv_heads_than_ranks_share_the_grouped_query_head():
    # 8 query heads over 2 KV heads (groups of 4): at 4 ranks, ranks 0-1 read head 0 and ranks 2-3 head 1;
    # rank r's query heads 2r, 2r+1 map to KV head (2r) // 4 under grouped-query attention.
    for rank in range(4):
        assert rank_kv_heads(2, rank, 4) == [(2 * rank) // 4]
    assert rank_kv_heads(4, 1, 2) == [2, 3]
    assert [rank_kv_heads(1, r, 8) for r in range(8)] == [[0]] * 8


@pytest.mark.parametrize(
    "size, message",
    [(3, "4 query heads"), (8, "4 query heads"), (0, "at least 1")],
)
def test_uneven_splits_are_refused(size, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size: .*{message}"):
        check_tensor_parallel(_text("e"), size)


def test_experts_width_must_split():
    text = _text("moe")
    text.moe_intermediate_size = 30
    with pytest.raises(ValueError, match="experts' width 30"):
        check_tensor_parallel(text, 4)


@pytest.mark.parametrize(
    "variant, size, ep",
    [
        ("e", 2, False),
        ("e", 4, False),
        ("moe", 2, False),
        ("moe", 4, False),
        ("moe", 4, True),
        ("31b", 4, False),
    ],
)
def test_rank_slices_put_back_together_are_the_checkpoint(variant, size, ep):
    """Every rank's model takes its slice of the same random draw: split tensors (heads, units, vocabulary)
    concatenate to the single-rank tensor, replicated ones are equal, row-parallel biases appear once."""
    from g4serve.config import Gemma4Config
    from g4serve.distributed import TensorParallel

    cfg = Gemma4Config(text=_text(variant))
    whole = build_model(cfg, torch.float32, "cpu", with_vision=False, with_audio=False)
    init_random_weights(whole, seed=3)
    ranks = []
    for rank in range(size):
        model = build_model(
            cfg,
            torch.float32,
            "cpu",
            with_vision=False,
            with_audio=False,
            tp=TensorParallel(rank, size, expert_parallel=ep),
        )
        init_random_weights(model, seed=3)
        ranks.append(model)
    plan0 = ranks[0].shard_plan
    for name, full in whole.state_dict().items():
        parts = [m.state_dict()[name] for m in ranks]
        shard = plan0.shard(name)
        if shard is None:
            for part in parts:
                torch.testing.assert_close(part, full, rtol=0, atol=0)
            continue
        for rank, part in enumerate(parts):
            expected = ShardPlan(cfg.text, rank, size, ep).take(name, full)
            torch.testing.assert_close(part, expected, rtol=0, atol=0, msg=name)
        if name.endswith(("q_proj.weight", "embed_tokens.weight", "gate_proj.weight", "down_proj.weight")):
            dim = shard.dim
            joined = torch.cat(parts, dim=dim).narrow(dim, 0, full.shape[dim])
            torch.testing.assert_close(joined, full, rtol=0, atol=0, msg=name)


def test_expert_parallel_holds_whole_experts():
    text = _text("moe")  # 4 experts of width 32
    local = shard_text_config(text, 2, expert_parallel=True)
    assert (local.num_experts, local.moe_intermediate_size) == (4, 32)  # the router's count, full width
    full = torch.randn(4, 64, 16)
    part = ShardPlan(text, 1, 2, expert_parallel=True).take(
        "language_model.layers.0.experts.gate_up_proj", full
    )
    torch.testing.assert_close(part, full[2:], rtol=0, atol=0)
    text.num_experts = 6
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks cannot split 6 experts"):
        check_tensor_parallel(text, 4, expert_parallel=True)
    check_tensor_parallel(text, 2, expert_parallel=True)


def test_vocab_padding_rows_are_zero():
    text = _text("e")
    text.vocab_size = 1022  # 4 ranks of 256 rows: the last holds 254 real ones and 2 padding rows
    plan = ShardPlan(text, 3, 4)
    full = torch.randn(1022, 8)
    part = plan.take("language_model.embed_tokens.weight", full)
    assert part.shape == (256, 8)
    torch.testing.assert_close(part[:254], full[768:], rtol=0, atol=0)
    assert not part[254:].any()
    assert plan.full_shape("language_model.embed_tokens.weight", part.shape) == (1022, 8)


def test_row_parallel_bias_only_on_rank_zero():
    text = _text("31b")
    bias = torch.randn(text.hidden_size)
    name = "language_model.layers.0.self_attn.o_proj.bias"
    torch.testing.assert_close(ShardPlan(text, 0, 2).take(name, bias), bias)
    assert not ShardPlan(text, 1, 2).take(name, bias).any()


@pytest.mark.parametrize(
    "option, value",
    [
        ("enable_lora", True),
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ],
)
def test_engine_options_not_combined_with_tensor_parallel_yet(option, value):
    with pytest.raises(ValueError, match=f"{option}: not supported with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, **{option: value})


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size: must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


def test_preset_config_is_read_without_weights():
    assert model_config("31b").text.num_global_key_value_heads == 4
    check_tensor_parallel(model_config("31b").text, 8)  # 31B's 4 global KV heads, replicated at TP 8


@pytest.mark.parametrize("quantization", ["w4a16-g32", "fp8"])
def test_quantized_preset_ranks_quantize_their_slice_of_the_same_draw(quantization):
    """--quantization at 2 ranks: each rank quantizes its slice of the single-GPU model's draw. Where every
    scale group lies inside one rank's slice (int4 groups of 32 columns; FP8 per-channel scales of a
    column-parallel layer's rows) the rank's dequantized weight is the slice of the single-GPU one; a
    row-parallel layer's per-channel FP8 scale is the max over the rank's columns only."""
    from g4serve.distributed import TensorParallel
    from g4serve.layers.quant import QuantLinear
    from g4serve.models.gemma4.loader import load_model

    def quantized(model):
        modules = model.named_modules()
        return {n: m.dequantize(torch.float32) for n, m in modules if isinstance(m, QuantLinear)}

    whole = quantized(load_model("tiny", quantization=quantization, with_vision=False, with_audio=False))
    assert whole
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        model = load_model("tiny", quantization=quantization, with_vision=False, with_audio=False, tp=tp)
        for name, weight in quantized(model).items():
            shard = model.shard_plan.shard(f"{name}.weight")
            if quantization == "fp8" and shard is not None and shard.dim == 1:
                continue  # row-parallel: the rank's own per-channel scale
            expected = whole[name] if shard is None else shard.take(whole[name])
            torch.testing.assert_close(weight, expected, rtol=0, atol=0, msg=name)
