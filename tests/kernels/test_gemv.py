"""The skinny (decode) GEMM kernel and its fused gate epilogues against the unfused ops, in Triton's
interpreter on CPU tensors: both the M=1 (elementwise) and the M>1 (tensor-core tile) paths, the swapped
tiles (weight on the MMA's M side) and split K of 9-64 rows, even and ragged K, partial column blocks.
fp32 to rounding noise; bf16 within one bf16 step of an fp32 product."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.act_mul import act_mul_reference
from g4serve.kernels.gemv import (
    GATE_UP,
    MUL,
    PLAIN,
    gemv_config,
    skinny_matmul,
    skinny_matmul_reference,
    use_skinny,
)

EPILOGUES = {"plain": PLAIN, "gate_up": GATE_UP, "mul": MUL}


def _inputs(m, n, k, epilogue, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    rows = 2 * n if epilogue == GATE_UP else n
    w = (torch.randn(rows, k, generator=gen) * k**-0.5).to(dtype)
    # the PLE operand is a strided view (one layer's slice of [T, L, P]), as the model passes it
    other = torch.randn(m, 3, n, generator=gen).to(dtype)[:, 1] if epilogue == MUL else None
    return x, w, other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize(
    "m,n,k,block_n,block_k,swap_ab,split_k",
    [
        (1, 40, 64, 8, 32, 0, 1),  # M=1, even K, full column blocks
        (1, 37, 100, 4, 32, 0, 1),  # M=1, ragged K and a partial last column block
        (3, 40, 96, 16, 32, 0, 1),  # M>1: tensor-core tiles with padded rows, partial column block
        (8, 16, 80, 16, 32, 0, 1),  # M>1, ragged K
        (12, 40, 96, 16, 32, 1, 1),  # the weight as the MMA's M side, rows padded to 16, partial columns
        (20, 24, 160, 16, 32, 1, 3),  # swapped, K split 3 ways (2 K tiles each, the last one short)
        (33, 16, 80, 16, 32, 1, 2),  # 64-row padding, ragged K across two splits
        (64, 32, 128, 16, 32, 0, 4),  # unswapped 64-row tiles, split 4 ways
    ],
)
def test_skinny_matmul_matches_unfused_ops(dtype, epilogue, m, n, k, block_n, block_k, swap_ab, split_k):
    ep = EPILOGUES[epilogue]
    x, w, other = _inputs(m, n, k, ep, dtype, seed=m * 1000 + n + k)
    act = "gelu_pytorch_tanh" if ep != PLAIN else None
    cfg = {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 1, "swap_ab": swap_ab}
    cfg["split_k"] = split_k
    out = skinny_matmul(x, w, ep, act, other, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.float32:
        ref = skinny_matmul_reference(x, w, ep, act, other)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        # fp32 products, rounded where the unfused path rounds (GEMM output, activation, result)
        ref = skinny_matmul_reference(x.float(), w.float(), PLAIN)
        if ep == GATE_UP:
            gate, up = ref.chunk(2, dim=-1)
            ref = act_mul_reference(act, gate.to(dtype), up.to(dtype))
        elif ep == MUL:
            ref = act_mul_reference(act, ref.to(dtype), other)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_silu_gate_up():
    x, w, _ = _inputs(1, 24, 64, GATE_UP, torch.float32, seed=7)
    out = skinny_matmul(
        x, w, GATE_UP, "silu", config={"block_n": 8, "block_k": 32, "num_warps": 4, "num_stages": 1}
    )
    torch.testing.assert_close(out, skinny_matmul_reference(x, w, GATE_UP, "silu"), atol=2e-5, rtol=2e-5)


def test_default_configs_cover_decode_shapes():
    # every e4b decode projection gets tiles that divide into whole K steps or a masked tail
    for m in (1, 2, 8, 9, 32, 64):
        for n, k in ((3072, 2560), (2560, 2048), (10240, 2560), (2560, 10240), (256, 2560), (2560, 256)):
            cfg = gemv_config(m, n, k)
            assert cfg["block_k"] <= max(16, 1 << (k - 1).bit_length())
            assert cfg["block_n"] >= (16 if m > 1 else 1)
            assert cfg.get("block_m", 16) >= m or m == 1
            # every split streams whole K tiles, at least one
            split = cfg.get("split_k", 1)
            k_tiles = -(-k // cfg["block_k"])
            assert split == 1 or (split <= k_tiles and -(-k_tiles // split) * (split - 1) < k_tiles)


@pytest.mark.parametrize("m", [8, 16, 32])
def test_routing_of_decode_projections_follows_the_h100_measurements(m):
    """``use_skinny`` at 8-32 rows as bench/gemv_kernels.py measured on an H100 (132 SMs): e4b's projections
    all on the swapped tiles (down's 40 column tiles split included), 31B's qkv, gates and LM head
    too, its o and down (N = 5,376 over K >= 8,192: 84 column tiles) unsplit at 8-16 rows and on cuBLAS
    at 17-32; one row always the skinny kernel; a long K into 26B-A4B's hidden size (N = 2,816: 44 tiles,
    under half the SMs) stays swapped."""
    for n, k in ((3072, 2560), (2560, 2048), (2560, 10240)):  # e4b: qkv, o, down
        assert use_skinny(m, n, k)
    assert use_skinny(m, 10240, 2560, GATE_UP)
    assert use_skinny(m, 16384, 5376) and use_skinny(m, 21504, 5376, GATE_UP) and use_skinny(m, 262144, 5376)
    for n, k in ((5376, 8192), (5376, 16384), (5376, 21504)):  # 31B: o (sliding, global), down
        assert use_skinny(m, n, k) == (m <= 16) and use_skinny(1, n, k)
        assert use_skinny(m, n, k, sms=80)  # a GPU on which those tiles fill every SM
        if m <= 16:
            assert gemv_config(m, n, k)["split_k"] == 1  # split 2 ways: 168 programs, 1.3 waves of 132 SMs
            assert gemv_config(m, n, k, sms=264)["split_k"] == 2
    assert use_skinny(m, 2816, 8192)


def test_decode_tiles_at_e4b_and_31b_shapes():
    """The tiles the measured rules give: e4b's down (40 column tiles) split 2 ways at 8-32 rows (3 ways past
    16 rows was faster kernel by kernel, not in the engine) and its PLE gate 4 ways, within one wave; 31B's
    gate/up at 8-16 rows in K tiles of 256 (K = 5,376), e4b's (K = 2,560) of 128."""
    for m in (8, 16):
        assert gemv_config(m, 2560, 10240)["split_k"] == 2
        assert gemv_config(m, 256, 2560)["split_k"] == 4
        assert gemv_config(m, 21504, 5376, GATE_UP)["block_k"] == 256
        assert gemv_config(m, 10240, 2560, GATE_UP)["block_k"] == 128
    assert gemv_config(4, 21504, 5376, GATE_UP)["block_k"] == 128  # 2-7 rows: not measured at 31B
    for m in (17, 32):  # past 16 rows e4b's down and global o: 80 programs, one wave
        assert {gemv_config(m, 2560, k)["split_k"] for k in (10240, 4096)} == {2}
        assert gemv_config(m, 2560, 4096)["num_stages"] == 4
        assert gemv_config(m, 2560, 10240)["num_stages"] == 5


def test_split_k_counters_are_left_zero_for_the_next_launch():
    """The split tiles' last program resets its counter: a second launch (as a replayed graph makes) sums
    fresh partials, not the first launch's count."""
    from g4serve.kernels._launch import launch_counters

    x, w, _ = _inputs(24, 32, 256, PLAIN, torch.float32, seed=5)
    cfg = {"block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1, "swap_ab": 1, "split_k": 4}
    first = skinny_matmul(x, w, config=cfg)
    assert int(launch_counters(x.device, 2, "skinny_matmul")[:2].abs().sum()) == 0
    second = skinny_matmul(x * 2, w, config=cfg)
    torch.testing.assert_close(second, 2 * first, atol=1e-5, rtol=1e-5)


def test_layers_dispatch_keeps_the_cpu_reference_path():
    """On CPU tensors the model's projections stay F.linear + the reference activation (bit-exact with
    transformers); the kernel is only taken for CUDA inputs."""
    from torch import nn

    from g4serve.layers.fused import gate_up_act, linear, linear_act_mul

    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(32, 48, bias=False)
    x = torch.randn(1, 32, generator=gen)
    assert torch.equal(linear(x, layer), layer(x))
    gate, up = layer(x).chunk(2, dim=-1)
    assert torch.equal(
        gate_up_act(x, layer, "gelu_pytorch_tanh"), act_mul_reference("gelu_pytorch_tanh", gate, up)
    )
    other = torch.randn(1, 48, generator=gen)
    assert torch.equal(
        linear_act_mul(x, layer, other, "silu"), skinny_matmul_reference(x, layer.weight, MUL, "silu", other)
    )


@pytest.mark.parametrize("m", [2, 16, 40, 64])
@pytest.mark.parametrize("epilogue", [PLAIN, GATE_UP, MUL])
def test_kernel_compiles_for_sm90(monkeypatch, m, epilogue):
    """Each launch the wrapper makes at e4b's decode shapes, compiled to an sm_90 cubin (the interpreter does
    not apply the compiled language's layout rules): the 16-row tiles, and for 9-64 rows the swapped tiles,
    split (o, down: their column tiles leave SMs idle) and not (gate/up)."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    import g4serve.kernels.gemv as module

    n, k = (10240, 2560) if epilogue == GATE_UP else (2560, 10240)
    rows = 2 * n if epilogue == GATE_UP else n
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(rows, k, dtype=torch.bfloat16, device="meta")
    other = torch.empty(m, n, dtype=torch.bfloat16, device="meta") if epilogue == MUL else None
    act = "gelu_pytorch_tanh" if epilogue != PLAIN else None
    launches = _launches(
        monkeypatch, module, "_gemv", lambda: module.skinny_matmul(x, weight, epilogue, act, other)
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs, use_pdl=True)
