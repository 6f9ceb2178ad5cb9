"""The quantized-weight GEMM (FP8 e4m3 with per-tensor / per-channel / block scales; packed int4 with groups
and optional zero points) against its reference (dequantize, then the unfused ops), in Triton's interpreter:
the M=1 path, one row tile (decode batches) and the 2-D grid (prefill), ragged K and N, partial scale
blocks, the gated epilogues. The reference's unpacking and dequantization against compressed-tensors' own."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN
from g4serve.kernels.quant_matmul import (
    dequantize_reference,
    quant_matmul,
    quant_matmul_config,
    quant_matmul_reference,
    unpack_int4,
)

EPILOGUES = {"plain": PLAIN, "gate_up": GATE_UP, "mul": MUL}


def _quantized(kind: str, rows: int, k: int, block: tuple[int, int], zeros: bool, gen: torch.Generator):
    """Random quantized weight tensors in the layout ``quant_matmul`` takes."""
    grid = (-(-rows // block[0]), -(-k // block[1]))
    # outputs of order one: |q| ~ 100 (fp8) or ~ 5 (int4) times the scale, summed over K
    scale = (torch.rand(grid, generator=gen) + 0.5) * (0.01 if kind == "fp8" else 0.2) / k**0.5
    if kind == "fp8":
        weight = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return weight, scale, None
    words = -(-k // 8)
    weight = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64)
    weight = weight.to(torch.int32)
    zero = torch.randint(-8, 8, grid, generator=gen).to(torch.int8) if zeros else None
    return weight, scale, zero


CASES = [
    # kind, m, n, k, scale block (rows, cols), zero points, config
    ("fp8", 1, 40, 64, (40, 64), False, (1, 8, 32)),  # per tensor
    ("fp8", 1, 37, 100, (1, 100), False, (1, 4, 32)),  # per channel, ragged K and N
    ("fp8", 3, 40, 96, (16, 32), False, (16, 16, 32)),  # blocks (partial row block), row tile
    ("fp8", 8, 24, 80, (1, 80), False, (16, 16, 32)),  # per channel, ragged K
    ("fp8", 70, 40, 64, (32, 32), False, (32, 16, 32)),  # 2-D grid (prefill)
    ("int4", 1, 40, 64, (1, 32), False, (1, 8, 64)),  # groups of 32, two groups per K tile
    ("int4", 1, 24, 128, (1, 64), True, (1, 8, 32)),  # zero points, a group over two K tiles
    ("int4", 2, 20, 96, (1, 32), True, (16, 16, 32)),  # row tile, ragged N
    ("int4", 5, 16, 72, (1, 8), False, (16, 16, 16)),  # ragged K (last word half used)
    ("int4", 6, 16, 64, (1, 64), True, (16, 16, 32)),  # per channel with zero points
    ("int4", 40, 24, 64, (1, 16), True, (16, 16, 32)),  # 2-D grid
    # 32-row tiles: the int4 planes swap operands, K tiles of 256 (K = 200 ragged, two groups of 128)
    ("int4", 40, 24, 200, (1, 128), True, (32, 16, 32)),
]


# every case plain in fp32 and bf16; the gated epilogues on int4 and on FP8 decode rows in fp32 (the
# epilogue code is shared: this keeps the interpreter time down)
PARAMS = [
    (dtype, epilogue, *case)
    for case in CASES
    for dtype in (torch.float32, torch.bfloat16)
    for epilogue in EPILOGUES
    if epilogue == "plain" or case[0] == "int4" or (dtype == torch.float32 and case[1] <= 8)
]


@pytest.mark.parametrize("dtype,epilogue,kind,m,n,k,block,zeros,tiles", PARAMS)
def test_quant_matmul_matches_reference(dtype, epilogue, kind, m, n, k, block, zeros, tiles):
    ep = EPILOGUES[epilogue]
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    rows = 2 * n if ep == GATE_UP else n
    if ep == GATE_UP and block[0] == n:  # per tensor: the stacked weight has one scale per half
        block = (n, block[1])
    weight, scale, zero = _quantized(kind, rows, k, block, zeros, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    other = torch.randn(m, 3, n, generator=gen).to(dtype)[:, 1] if ep == MUL else None
    act = "gelu_pytorch_tanh" if ep != PLAIN else None
    block_m, block_n, block_k = tiles
    cfg = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 1}
    out = quant_matmul(x, weight, scale, block, k, zero, ep, act, other, config=cfg)
    ref = quant_matmul_reference(x, weight, scale, block, k, zero, ep, act, other)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "kind,m,k,block,zeros,block_m",
    [
        ("int4", 3, 600, (1, 32), True, 16),  # 3 K tiles of 128 over 2 splits: 256 + 256 + 88
        ("int4", 20, 600, (1, 128), False, 32),  # swapped planes, K tiles of 256
        ("fp8", 3, 600, (1, 600), False, 16),
    ],
)
def test_split_k_sums_every_range_once(kind, m, k, block, zeros, block_m):
    gen = torch.Generator().manual_seed(k + m)
    n = 24
    weight, scale, zero = _quantized(kind, 2 * n, k, block, zeros, gen)
    x = torch.randn(m, k, generator=gen)
    cfg = {"block_m": block_m, "block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1, "split_k": 2}
    out = quant_matmul(x, weight, scale, block, k, zero, GATE_UP, "silu", config=cfg)
    ref = quant_matmul_reference(x, weight, scale, block, k, zero, GATE_UP, "silu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_default_configs_nest_with_scale_blocks():
    """Every decode and prefill shape of e4b / 31b gets K tiles that nest with 32/128 groups and blocks."""
    for m in (1, 4, 8, 32, 64, 512):
        for n, k in ((3072, 2560), (2560, 2048), (20480, 2560), (2560, 10240), (256, 2560), (5376, 21504)):
            cfg = quant_matmul_config(m, n, k)
            for bk in (32, 128):
                assert cfg["block_k"] % bk == 0 or bk % cfg["block_k"] == 0
            assert cfg["block_k"] % 8 == 0


@pytest.mark.parametrize("k", [64, 100])
def test_unpack_matches_compressed_tensors(k):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    gen = torch.Generator().manual_seed(k)
    values = torch.randint(-8, 8, (12, k), generator=gen).to(torch.int8)
    packed = pack_to_int32(values, 4)
    assert torch.equal(unpack_int4(packed, k), values)
    assert torch.equal(unpack_int4(packed, k), unpack_from_int32(packed, 4, torch.Size([12, k])))


@pytest.mark.parametrize(
    "strategy,args",
    [
        ("channel", dict(num_bits=8, type="float", strategy="channel")),
        ("block", dict(num_bits=8, type="float", strategy="block", block_structure=[16, 32])),
        ("group", dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)),
    ],
)
def test_dequantize_matches_compressed_tensors(strategy, args):
    """(q - z) * s as compressed-tensors' own ``dequantize`` computes it, in fp32."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    gen = torch.Generator().manual_seed(1)
    n, k = 40, 64
    qargs = QuantizationArgs(**args)
    block = {"channel": (1, k), "block": (16, 32), "group": (1, 32)}[strategy]
    kind = "fp8" if args["type"] == "float" else "int4"
    weight, scale, zero = _quantized(kind, n, k, block, zeros=kind == "int4", gen=gen)
    if kind == "int4":
        q = unpack_int4(weight, k)
        theirs = dequantize(q, scale, zero, qargs)
    else:
        theirs = dequantize(weight, scale, None, qargs)
    ours = dequantize_reference(weight, scale, block, k, zero, torch.float32)
    assert torch.equal(ours, theirs.float())


@pytest.mark.parametrize(
    "int4,zeros,planes",
    [(False, False, 0), (True, True, 0), (True, True, 1), (True, False, 1), (True, True, 3)],
)
@pytest.mark.parametrize("m,epilogue", [(1, GATE_UP), (8, MUL), (48, GATE_UP), (200, PLAIN)])
def test_kernel_compiles_for_hopper_without_a_gpu(int4, zeros, planes, m, epilogue):
    """Triton compiles the kernel to an sm_90 cubin on the CPU machine (its bundled ptxas): every path's
    compiled form (bf16 tensor-core tiles, int4 nibble planes in fp32 and on bf16x2 lanes (PTX), unswapped
    and swapped, the one-row planes, PDL) is checked before a device runs it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from g4serve.kernels.quant_matmul import _groups_per_tile, _quant_matmul, int4_swap, int4_tiles

    fn = _quant_matmul.compiled
    n, k = 2048, 2560
    cfg = int4_tiles(quant_matmul_config(m, n, k, epilogue), int4)
    ints = "M N K num_groups stride_xm stride_wn stride_sn stride_zn stride_em stride_ym scale_bn scale_bk"
    signature = {"X": "*bf16", "W": "*i32" if int4 else "*fp8e4nv", "S": "*bf16", "Z": "*i8", "E": "*bf16"}
    signature |= {"Y": "*bf16"} | {name: "i32" for name in ints.split()}
    constexprs = dict(
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        GROUPS=_groups_per_tile(cfg["block_k"], 32 if int4 else 128, k),
        INT4=int4,
        HAS_ZERO=zeros,
        EPILOGUE=epilogue,
        ACT=0,
        USE_DOT=cfg["block_m"] > 1,
        UPCAST=False,
        DOT_PRECISION="tf32",
        USE_PDL=m <= 64,
        SWAP=int4 and m > 1 and int4_swap(cfg["block_m"]),
        PLANES=planes if planes != 3 or m == 1 else 1,  # 3: the one-row planes (PLANES_ROWS)
    )
    names = list(fn.arg_names)
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(c),): v for c, v in constexprs.items()}
    )
    try:
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
        )
    except (FileNotFoundError, PermissionError) as exc:  # no bundled ptxas on this machine
        pytest.skip(f"Triton cannot reach ptxas here: {exc}")
    assert compiled.asm["cubin"]


@pytest.mark.parametrize(
    "m,n,k,group,zeros,epilogue,tiles",
    [
        (2, 20, 96, 32, True, "gate_up", (16, 16, 32)),  # K tiles of 128 over a ragged K; four groups a tile
        (8, 24, 256, 128, False, "plain", (16, 16, 32)),  # symmetric, a group a tile
        (5, 16, 128, 64, True, "mul", (16, 16, 32)),
        (40, 24, 200, 128, True, "gate_up", (32, 16, 32)),  # swapped operands, K tiles of 256
    ],
)
def test_int4_planes_two_words_at_a_time_give_the_same_bits(
    monkeypatch, m, n, k, group, zeros, epilogue, tiles
):
    """The PTX planes' formulation (``PLANES_EMULATED``: all 8 planes of a tile at once from the bf16 scale
    and -(128 + 8 + z), the values the PTX computes on bf16x2 lanes) against the fp32 planes, in the
    interpreter: the same bits, bf16 activations and scales (the PTX path's inputs).
    tests/gpu/test_quant_gpu.py runs the PTX itself against them."""
    from g4serve.kernels import quant_matmul as qm

    ep = EPILOGUES[epilogue]
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    rows = 2 * n if ep == GATE_UP else n
    weight, scale, zero = _quantized("int4", rows, k, (1, group), zeros, gen)
    scale = scale.bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    other = torch.randn(m, n, generator=gen).bfloat16() if ep == MUL else None
    act = "gelu_pytorch_tanh" if ep != PLAIN else None
    block_m, block_n, block_k = tiles
    cfg = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 1}
    assert qm.int4_planes(x, scale, 16) == qm.PLANES_FP32  # the CPU's default
    fp32 = quant_matmul(x, weight, scale, (1, group), k, zero, ep, act, other, config=cfg)
    monkeypatch.setattr(qm, "int4_planes", lambda *args: qm.PLANES_EMULATED)
    emulated = quant_matmul(x, weight, scale, (1, group), k, zero, ep, act, other, config=cfg)
    ref = quant_matmul_reference(x, weight, scale, (1, group), k, zero, ep, act, other)
    assert ref.float().abs().max() > 0.1
    assert torch.equal(emulated, fp32)
    torch.testing.assert_close(emulated.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_int4_planes_path_choice(monkeypatch):
    """PTX planes only for bf16 activations and bf16 scales on CUDA; the CPU and other dtypes take fp32; one
    row takes the one-row planes anywhere (the reference tests above run them), unless
    G4SERVE_INT4_PLANES=fp32."""
    from g4serve.kernels import quant_matmul as qm

    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert qm.int4_planes(x[:1], torch.zeros(1), 1) == qm.PLANES_ROWS
    monkeypatch.setattr(qm, "_planes_on", lambda: False)
    assert qm.int4_planes(x[:1], torch.zeros(1), 1) == qm.PLANES_FP32
    monkeypatch.undo()
    assert qm.int4_planes(x, torch.zeros(1, dtype=torch.bfloat16), 16) == qm.PLANES_FP32  # on the CPU
    assert qm.int4_planes(x.float(), torch.zeros(1), 16) == qm.PLANES_FP32


@pytest.mark.parametrize(
    "zeros,group,epilogue", [(False, 128, "plain"), (True, 32, "gate_up"), (True, 64, "mul")]
)
def test_one_row_planes_agree_with_whole_tile_dequantization(monkeypatch, zeros, group, epilogue):
    """The one-row int4 path by nibble planes (the default) against the whole-tile path it replaced
    (``G4SERVE_INT4_PLANES=fp32``), fp32 activations: the same products summed in another order."""
    from g4serve.kernels import quant_matmul as qm

    ep = EPILOGUES[epilogue]
    gen = torch.Generator().manual_seed(group + zeros)
    n, k = 24, 512
    weight, scale, zero = _quantized("int4", 2 * n if ep == GATE_UP else n, k, (1, group), zeros, gen)
    x = torch.randn(1, k, generator=gen)
    other = torch.randn(1, n, generator=gen) if ep == MUL else None
    act = "gelu_pytorch_tanh" if ep != PLAIN else None
    cfg = {"block_m": 1, "block_n": 4, "block_k": 256, "num_warps": 2, "num_stages": 1}
    rows = quant_matmul(x, weight, scale, (1, group), k, zero, ep, act, other, config=cfg)
    monkeypatch.setattr(qm, "_planes_on", lambda: False)
    tiles = quant_matmul(x, weight, scale, (1, group), k, zero, ep, act, other, config=cfg)
    assert tiles.abs().max() > 0.1
    torch.testing.assert_close(rows, tiles, atol=1e-5, rtol=1e-5)
