"""The W8A8 FP8 GEMM (activations quantized per token and 128-column group inside the kernel, FP8 tensor-core
products) against its torch reference in Triton's interpreter: decode rows and a wider batch, per-tensor,
per-channel and 128 x 128 block weight scales, ragged K and N, the gated epilogues; the activation quantizer
rounding as torch's cast; and the reference close to the dequantized bf16 product it approximates."""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.fp8_matmul as fp8_module
from g4serve.kernels.act_mul import act_mul_reference
from g4serve.kernels.fp8_matmul import (
    fp8_matmul,
    fp8_matmul_config,
    fp8_matmul_reference,
    fp8_matmul_supported,
    one_row_config,
    one_row_supported,
    quantize_activation_groups,
)
from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN
from g4serve.kernels.quant_matmul import dequantize_reference

FP8 = torch.float8_e4m3fn


def _weight(rows: int, k: int, block: tuple[int, int], gen: torch.Generator):
    grid = (-(-rows // block[0]), -(-k // block[1]))
    scale = (torch.rand(grid, generator=gen) + 0.5) * 0.01 / k**0.5
    weight = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    return weight, scale


def _tiles(block_m=16, block_n=16, num_warps=4, num_stages=2, **extra) -> dict[str, int]:
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, **extra}


def _one_row(block_n=2, block_k=256, num_warps=4) -> dict[str, int]:
    return {"one_row": 1, "block_n": block_n, "block_k": block_k, "num_warps": num_warps}


CASES = [
    # m, n, k, scale block, epilogue, activation, config
    (1, 48, 256, (1, 256), PLAIN, None, None),  # per channel, one decode row
    (3, 40, 200, (1, 200), PLAIN, None, _tiles()),
    (5, 48, 256, (48, 256), PLAIN, None, None),  # per tensor
    (2, 130, 384, (128, 128), PLAIN, None, _tiles(block_n=32)),
    (4, 24, 256, (1, 256), GATE_UP, "gelu_pytorch_tanh", None),
    (2, 24, 136, (1, 136), MUL, "silu", _tiles(block_n=8, num_warps=2, num_stages=1)),
    (70, 40, 256, (128, 128), PLAIN, None, _tiles(block_m=32)),
    # 17..64 rows with the weight on the MMA's M side: the batch padded to 32 and to 64, split and not
    (
        20,
        72,
        600,
        (1, 600),
        GATE_UP,
        "gelu_pytorch_tanh",
        _tiles(block_m=32, block_n=64, swap_ab=1, split_k=3),
    ),
    (40, 40, 384, (128, 128), PLAIN, None, _tiles(block_m=64, block_n=32, swap_ab=1)),
    (64, 24, 520, (1, 520), MUL, "silu", _tiles(block_m=64, block_n=64, swap_ab=1, split_k=2)),
    # the weight tile on the MMA's M side (W @ X^T), plain and gated
    (3, 72, 384, (128, 128), PLAIN, None, _tiles(block_n=64, swap_ab=1)),
    (2, 40, 256, (1, 256), GATE_UP, "gelu_pytorch_tanh", _tiles(block_n=32, swap_ab=1)),
    # serial split-K: K groups over several programs per tile (the last split shorter: ragged K), each
    # epilogue, and a split left empty (4 splits of 2 groups)
    (2, 72, 600, (1, 600), PLAIN, None, _tiles(block_n=32, swap_ab=1, split_k=3)),
    (3, 24, 520, (128, 128), GATE_UP, "silu", _tiles(split_k=3)),
    (1, 24, 384, (1, 384), MUL, "gelu_pytorch_tanh", _tiles(swap_ab=1, split_k=2)),
    (2, 40, 256, (1, 256), PLAIN, None, _tiles(split_k=4)),
    # one row on the CUDA cores (``_fp8_gemv``): per channel and per tensor, ragged K and N, block scales
    # that vary along K (gate and up rows in their own blocks), each epilogue, 1 / 2 / 4 rows a program
    (1, 45, 200, (1, 200), PLAIN, None, _one_row(block_n=1, block_k=128)),
    (1, 48, 600, (96, 600), PLAIN, None, _one_row(block_k=256)),
    (1, 130, 384, (128, 128), PLAIN, None, _one_row(block_n=2, block_k=128)),
    (1, 128, 520, (128, 128), GATE_UP, "gelu_pytorch_tanh", _one_row(block_n=4, block_k=256)),
    (1, 40, 384, (1, 384), GATE_UP, "silu", _one_row(block_n=4, block_k=128)),
    (1, 24, 256, (1, 256), MUL, "gelu_pytorch_tanh", _one_row(block_k=512)),
    # a row the words do not divide (K = 198): the tensor cores' tiles instead
    (1, 40, 198, (1, 198), PLAIN, None, _one_row()),
]


@pytest.mark.parametrize("m, n, k, block, epilogue, activation, config", CASES)
def test_kernel_matches_reference(m, n, k, block, epilogue, activation, config):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    rows = 2 * n if epilogue == GATE_UP else n
    weight, scale = _weight(rows, k, block, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    x[0, :7] *= 50  # one group with a large outlier: its own scale
    other = torch.randn(m, n, generator=gen).bfloat16() if epilogue == MUL else None
    got = fp8_matmul(x, weight, scale, block, epilogue, activation, other, config)
    assert got.shape == (m, n) and got.dtype == x.dtype
    # products of e4m3 values are exact in fp32; only the summation order differs (a bf16 ulp at most)
    plain = fp8_matmul(x, weight, scale, block, PLAIN, config=config)
    torch.testing.assert_close(
        plain.float(), fp8_matmul_reference(x, weight, scale, block).float(), rtol=8e-3, atol=1e-3
    )
    if epilogue != PLAIN:
        # the fused epilogue on the kernel's own products, as the unfused activation kernel computes it
        # (a one-ulp difference in a large product would otherwise move act(a) * b by more than an ulp)
        gate, up = plain.chunk(2, dim=-1) if epilogue == GATE_UP else (plain, other)
        want = act_mul_reference(activation, gate, up)
        torch.testing.assert_close(
            got.float(), want.float(), rtol=2e-2, atol=3e-2
        )  # as tests/kernels/test_gemv
        ref = fp8_matmul_reference(x, weight, scale, block, epilogue, activation, other)
        # act(a) and act(a) * b each rounded to bf16 in the kernel (as the unfused kernels store them): 2 ulps
        assert (got.float() - ref.float()).norm() <= 0.02 * ref.float().norm()


def test_split_k_is_deterministic_and_leaves_its_counters_zero():
    """The last program of a tile sums the partials in split order: two launches give the same bits, equal
    to the unsplit kernel's within fp32 summation order, and every tile counter is back at zero."""
    from g4serve.kernels._launch import _COUNTERS

    gen = torch.Generator().manual_seed(5)
    weight, scale = _weight(96, 1024, (1, 1024), gen)
    x = torch.randn(4, 1024, generator=gen).bfloat16()
    cfg = _tiles(block_n=32, swap_ab=1, split_k=4)
    first = fp8_matmul(x, weight, scale, (1, 1024), config=cfg)
    second = fp8_matmul(x, weight, scale, (1, 1024), config=cfg)
    assert torch.equal(first, second)
    assert not _COUNTERS[(x.device, "fp8_matmul")].any()
    unsplit = fp8_matmul(x, weight, scale, (1, 1024), config={**cfg, "split_k": 1})
    torch.testing.assert_close(first.float(), unsplit.float(), rtol=8e-3, atol=1e-3)


def test_activation_groups_round_as_torch_casts():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=gen).bfloat16() * 4
    x[1, 128:256] = 0.0  # an all-zero group keeps the scale floor
    q, scale = quantize_activation_groups(x)
    assert q.shape == (3, 300) and scale.shape == (3, 3)
    assert scale[1, 1] == 1e-12 and (q[1, 128:256].float() == 0).all()
    groups = torch.nn.functional.pad(x.float(), (0, 84)).view(3, 3, 128)
    want = (groups / scale[..., None]).to(FP8).view(3, -1)[:, :300]
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert (q.float().abs().view(3, -1)[:, :256].amax(dim=1) == 448).all()  # each group reaches the range


def test_reference_approximates_the_dequantized_product():
    """Quantizing activations per 128-group costs about e4m3's precision (~2^-4 relative per value)."""
    gen = torch.Generator().manual_seed(2)
    weight, scale = _weight(64, 512, (1, 512), gen)
    x = torch.randn(4, 512, generator=gen).bfloat16()
    approx = fp8_matmul_reference(x, weight, scale, (1, 512)).float()
    exact = x.float() @ dequantize_reference(weight, scale, (1, 512), 512, None, torch.float32).t()
    rel = (approx - exact).norm() / exact.norm()
    assert rel < 0.03, rel


def test_supported_scale_blocks_and_tiles(monkeypatch):
    assert fp8_matmul_supported((1, 5376), 5376) and fp8_matmul_supported((128, 128), 5376)
    assert not fp8_matmul_supported((1, 64), 512)  # a weight scale changing inside an activation group
    h100 = 132
    # one row: the CUDA cores' kernel for weights of up to 2^25 elements (all of e4b's), the tensor cores past
    # them (31B's), whatever the device; "fma" / "mma" force either
    assert fp8_matmul_config(1, 2560, 2048, h100, "auto") == one_row_config(2560, 2048)
    assert fp8_matmul_config(1, 10240, 2560, 0, "auto", GATE_UP) == one_row_config(10240, 2560, GATE_UP)
    assert "one_row" not in fp8_matmul_config(1, 5376, 8192, h100, "auto")
    assert fp8_matmul_config(1, 5376, 21504, h100, "fma") == one_row_config(5376, 21504)
    assert "one_row" not in fp8_matmul_config(1, 2560, 2048, h100, "mma")
    # K steps of 2,048 bytes for long rows that divide by it, else 1,024 or 512; 8 rows for a wide gated pair
    assert [one_row_config(2560, k)["block_k"] for k in (2048, 2560, 4096, 5376, 10240)] == [
        1024,
        512,
        2048,
        512,
        2048,
    ]
    assert (
        one_row_config(10240, 2560, GATE_UP)["block_n"] == 8 and one_row_config(10240, 2560)["block_n"] == 4
    )
    assert one_row_supported(1, 130, (128, 128), 384, PLAIN, 2)
    assert not one_row_supported(1, 130, (128, 128), 384, GATE_UP, 4)  # up rows across two scale blocks
    assert not one_row_supported(1, 130, (96, 128), 384, PLAIN, 64)  # rows across two scale blocks
    assert not one_row_supported(2, 128, (1, 384), 384, PLAIN, 2)
    monkeypatch.setattr(fp8_module, "ONE_ROW", "mma")  # the tensor cores' tiles below
    assert fp8_matmul_config(1, 4096, 4096, h100)["block_m"] == 16
    assert fp8_matmul_config(33, 4096, 4096, h100)["block_m"] == 64
    # 17..32 rows: the decode rule at a 32-row token tile; 33..64: narrow shapes swap and split into 3 at most
    assert fp8_matmul_config(32, 2560, 10240, h100) | {"split_k": 0} == _tiles(
        block_m=32, block_n=64, num_stages=4, swap_ab=1, split_k=0
    )
    assert fp8_matmul_config(32, 10240, 2560, h100)["swap_ab"] == 1
    assert fp8_matmul_config(64, 2560, 10240, h100)["split_k"] == 3
    assert "swap_ab" not in fp8_matmul_config(64, 10240, 2560, h100)  # 160 column tiles fill the SMs
    assert fp8_matmul_config(512, 4096, 4096, h100)["block_m"] == 128
    # 31B decode: the wide projections fill the SMs unsplit; the ones back to 5376 columns (84 tiles) split K
    assert "split_k" not in fp8_matmul_config(1, 21504, 5376, h100)
    assert fp8_matmul_config(1, 5376, 21504, h100)["split_k"] == 4
    assert fp8_matmul_config(8, 5376, 8192, h100)["split_k"] == 4
    assert fp8_matmul_config(1, 2560, 10240, h100)["split_k"] == 7  # E4B's down: 40 column tiles
    assert fp8_matmul_config(1, 2560, 2048, h100)["split_k"] == 4  # E4B's o: 16 groups, 4 each
    assert "split_k" not in fp8_matmul_config(1, 5376, 768, h100)  # too little K to share
    assert "split_k" not in fp8_matmul_config(1, 5376, 21504, 0)  # no SM count (the interpreter)


@pytest.mark.parametrize(
    "m, config",
    [
        (1, None),
        (32, None),
        (32, fp8_matmul_config(32, 5376, 21504, 132)),  # 32 rows, swapped and split
        (64, fp8_matmul_config(64, 5376, 21504, 132)),
        (200, None),
        (1, fp8_matmul_config(1, 5376, 5376, 132, "mma")),  # an H100's decode tiles
        (1, one_row_config(5376, 5376)),  # the CUDA cores' one-row kernel
        (1, one_row_config(5376, 5376) | {"block_n": 16, "block_k": 256}),
        (4, _tiles(block_n=64, num_stages=6, swap_ab=1, split_k=3)),
    ],
)
@pytest.mark.parametrize("epilogue", [PLAIN, GATE_UP, MUL])
def test_kernel_compiles_for_sm90(monkeypatch, m, config, epilogue):
    """The interpreter does not apply the compiled language's rules (constexpr globals, FP8 MMA operand
    layouts): each launch the wrapper makes at 31B's shapes is compiled to an sm_90 cubin here."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    import g4serve.kernels.fp8_matmul as module

    n, k = 5376, 5376
    rows = 2 * n if epilogue == GATE_UP else n
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(rows, k, dtype=FP8, device="meta")
    scale = torch.empty(rows, 1, device="meta")
    other = torch.empty(m, n, dtype=torch.bfloat16, device="meta") if epilogue == MUL else None
    act = "gelu_pytorch_tanh" if epilogue != PLAIN else None
    launches = _launches(
        monkeypatch,
        module,
        "_quantize_groups _fp8_matmul _fp8_gemv",
        lambda: fp8_matmul(x, weight, scale, (1, k), epilogue, act, other, config),
    )
    for fn, args, kwargs in launches:
        if "PTX" in kwargs:  # the one-row kernel's e4m3 widening as the GPU runs it (inline PTX), not the
            kwargs = kwargs | {"PTX": True}  # interpreter's cast that meta tensors select
        _compile(fn, args, kwargs, use_pdl=m <= 64)


def test_outgrown_launch_counters_stay_alive_for_the_graphs_that_hold_them():
    """A launch needing more counters than the kernel's buffer gets a larger one; the old buffer is kept,
    since CUDA graphs captured earlier still point at it."""
    from g4serve.kernels import _launch

    device = torch.device("cpu")
    first = _launch.launch_counters(device, 10, "test-kernel")
    assert first is not None and first.numel() == 4096 and not first.any()
    assert _launch.launch_counters(device, 4096, "test-kernel") is first
    grown = _launch.launch_counters(device, 5000, "test-kernel")
    assert grown is not None and grown.numel() == 5000 and any(t is first for t in _launch._OUTGROWN)
