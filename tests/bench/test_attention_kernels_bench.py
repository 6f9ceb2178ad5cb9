"""bench/attention_kernels.py on the CPU: the FP8 cache it builds is one the paged decode kernel reads as the
engine's (Triton's interpreter: the same attention as a bf16 cache holding the scaled values), and its
command line takes both storages."""

from __future__ import annotations

import argparse

import torch
from bench_scripts import load_script

from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE
from g4serve.kernels.paged_decode import paged_decode_attention

bench = load_script("attention_kernels")


def test_fp8_inputs_read_as_their_scaled_values():
    args = argparse.Namespace(page_size=16, kv_heads=2, q_heads=4)
    torch.manual_seed(0)
    inputs = bench._paged_inputs(2, 40, args, 32, torch.bfloat16, 1, kv_fp8=True, device="cpu")
    k, v, tables, q, scales = inputs
    assert k.dtype == v.dtype == KV_FP8_DTYPE and set(scales) == {"k_scale", "v_scale"}
    assert scales["k_scale"].shape == (2,) and scales["k_scale"].dtype == torch.float32
    seq_lens = torch.tensor([40, 23], dtype=torch.int32)
    got = paged_decode_attention(q, k, v, tables, seq_lens, 16, num_splits=2, **scales)
    # the same cache in bf16, each value times its head's scale (exact: e4m3 values times 0.5)
    k_ref = (k.float() * scales["k_scale"][None, :, None]).bfloat16()
    v_ref = (v.float() * scales["v_scale"][None, :, None]).bfloat16()
    want = paged_decode_attention(q, k_ref, v_ref, tables, seq_lens, 16, num_splits=2)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    plain = bench._paged_inputs(2, 40, args, 32, torch.bfloat16, 1, device="cpu")
    assert plain[0].dtype == torch.bfloat16 and plain[4] == {}


def test_command_line_takes_both_storages():
    args = bench.parse_args(["--kinds", "decode", "--kv-cache-dtype", "auto", "fp8"])
    assert args.kv_cache_dtype == ["auto", "fp8"]
    assert bench.parse_args([]).kv_cache_dtype == ["auto"]
