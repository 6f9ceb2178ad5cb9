"""The persistent decode-tail kernel (``kernels/decode_tail.py``) against the separate ops, in Triton's
interpreter on CPU tensors: the M=1 (elementwise) and M>1 (tensor-core tile) paths, ragged tiles in every
phase, with and without the PLE end, the layer scalar and the next norm, several programs sharing the
tickets; the counters are back at zero after each launch, so a second launch (a CUDA graph's replay)
computes the same. Then the launch compiles to an sm_90 cubin (the interpreter does not apply the compiled
language's rules)."""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.decode_tail as decode_tail_module
from g4serve.kernels.act_mul import act_mul_reference
from g4serve.kernels.decode_tail import (
    COUNTER_STRIDE,
    COUNTERS,
    TRACE_PHASES,
    TRACE_SLOTS,
    PerLayerInput,
    TailWeights,
    decode_tail,
    decode_tail_reference,
    new_counters,
    new_trace,
)
from g4serve.kernels.rms_norm import fused_rms_norm_reference

EPS = 1e-6
SMALL = {
    **{f"bn_{p}": 16 for p in "oabgp"},
    **{f"bk_{p}": 32 for p in "oabgp"},
    "num_warps": 4,
    "programs_per_sm": 1,
}
ONE_ROW = {
    **{f"bn_{p}": 4 for p in "oabgp"},
    **{f"bk_{p}": 32 for p in "oabgp"},
    "bk_b": 64,
    "num_warps": 4,
    "programs_per_sm": 1,
}


class Layer:
    """A tiny dense layer's tail operands (strided activations, as the model's can be)."""

    def __init__(self, m: int, h: int, q: int, i: int, p: int, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(dtype)

        def norm(cols):
            return (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)

        self.attn = randn(m, q)
        self.residual = randn(m, 2, h)[:, 1]
        self.o, self.gate_up, self.down = (
            randn(h, q, std=q**-0.5),
            randn(2 * i, h, std=h**-0.5),
            randn(h, i, std=i**-0.5),
        )
        self.post_attn, self.pre_ff, self.post_ff, self.next = norm(h), norm(h), norm(h), norm(h)
        self.scale = torch.tensor([0.75]).to(dtype)
        self.ple = None
        if p:
            inputs = randn(m, 3, p)[:, 2]  # one layer's slice of [T, L, P]
            self.ple = PerLayerInput(randn(p, h, std=h**-0.5), randn(h, p, std=p**-0.5), inputs, norm(h))

    def operands(self):
        weights = TailWeights(self.o, self.post_attn, self.pre_ff, self.gate_up, self.down, self.post_ff)
        return self.attn, self.residual, weights

    def fused(self, act, counters, scale=True, next_norm=True, config=None, programs=None):
        return decode_tail(
            *self.operands(), EPS, act, counters, self.ple,
            self.scale if scale else None, self.next if next_norm else None, config, programs,
        )  # fmt: skip

    def reference(self, act, scale=True, next_norm=True):
        return decode_tail_reference(
            *self.operands(),
            EPS,
            act,
            self.ple,
            self.scale if scale else None,
            self.next if next_norm else None,
        )


@pytest.mark.parametrize(
    "m,h,q,i,p,cfg,programs",
    [
        (1, 64, 32, 96, 16, ONE_ROW, 3),  # one row, every tile full
        (1, 72, 40, 100, 12, ONE_ROW, 5),  # one row, ragged K and partial last tiles in every phase
        (3, 64, 32, 96, 16, SMALL, 3),  # tensor-core tiles with padded rows
        (8, 80, 48, 120, 24, SMALL, 2),  # eight rows, ragged everywhere
        (2, 48, 32, 40, 16, SMALL, 200),  # more programs than tasks
        (1, 72, 40, 100, 12, ONE_ROW | {"grab": 3}, 4),  # tickets 3 a grab, grabs across phase ends
        (3, 64, 32, 96, 16, SMALL | {"grab": 4}, 50),  # 4 a grab, more programs than grabs
        (1, 72, 40, 100, 12, ONE_ROW | {"norm_cols": 16}, 4),  # norms in 5 chunks a row, the last ragged
        (3, 64, 32, 96, 16, SMALL | {"norm_cols": 32, "grab": 3}, 5),  # 2 chunks a row, grabs across them
    ],
)
@pytest.mark.parametrize("with_ple", [True, False])
@pytest.mark.parametrize("with_scale,with_next", [(True, True), (False, False)])
def test_matches_the_separate_ops_fp32(m, h, q, i, p, cfg, programs, with_ple, with_scale, with_next):
    layer = Layer(m, h, q, i, p if with_ple else 0, torch.float32, seed=m * 100 + h + i)
    counters = new_counters("cpu")
    out, out2 = layer.fused("gelu_pytorch_tanh", counters, with_scale, with_next, cfg, programs)
    ref, ref2 = layer.reference("gelu_pytorch_tanh", with_scale, with_next)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    if with_next:
        torch.testing.assert_close(out2, ref2, atol=3e-5, rtol=3e-5)
    else:
        assert out2 is None
    assert counters.tolist() == [0] * (COUNTERS * COUNTER_STRIDE)


def _rounded_reference(layer: Layer, act: str):
    """fp32 products, rounded to the model dtype where the separate ops round them (every GEMM output, the
    activation, each norm's result)."""
    dtype = layer.attn.dtype

    def mm(x, w):
        return (x.float() @ w.float().T).to(dtype)

    h1, x1 = fused_rms_norm_reference(
        mm(layer.attn, layer.o), layer.post_attn, EPS, layer.residual, None, layer.pre_ff
    )
    gate, up = (x1.float() @ layer.gate_up.float().T).chunk(2, dim=-1)
    y = mm(act_mul_reference(act, gate.to(dtype), up.to(dtype)), layer.down)
    h2, _ = fused_rms_norm_reference(y, layer.post_ff, EPS, h1)
    g = act_mul_reference(act, mm(h2, layer.ple.gate), layer.ple.inputs)
    return fused_rms_norm_reference(
        mm(g, layer.ple.proj), layer.ple.post_norm, EPS, h2, layer.scale, layer.next
    )


@pytest.mark.parametrize("m,cfg", [(1, ONE_ROW), (5, SMALL)])
def test_bf16_rounds_where_the_separate_ops_round(m, cfg):
    layer = Layer(m, 96, 64, 160, 32, torch.bfloat16, seed=11 + m)
    out, out2 = layer.fused("silu", new_counters("cpu"), config=cfg)
    ref, ref2 = _rounded_reference(layer, "silu")
    assert out.dtype == torch.bfloat16 and out2.dtype == torch.bfloat16
    # a rounding flip of an intermediate moves a result by about one bf16 step
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(out2.float(), ref2.float(), atol=4e-2, rtol=2e-2)


def test_a_second_launch_on_the_same_counters_computes_the_same():
    layer = Layer(4, 64, 32, 96, 16, torch.float32, seed=3)
    counters = new_counters("cpu")
    first = layer.fused("silu", counters, config=SMALL, programs=4)
    assert counters.tolist() == [0] * (COUNTERS * COUNTER_STRIDE)
    second = layer.fused("silu", counters, config=SMALL, programs=4)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("with_ple", [True, False])
def test_a_traced_launch_records_where_each_program_left_each_phase(with_ple):
    """The interpreter runs the programs one after another, so the first takes every ticket in order: its
    records hold each phase's end (-1 for the phases this tail has not), the others' the first ticket past
    the last phase. The outputs are the untraced launch's."""
    m, h, q, i, p = 2, 64, 32, 96, 16 if with_ple else 0
    layer = Layer(m, h, q, i, p, torch.float32, seed=9)
    cfg = SMALL | {"grab": 2, "norm_cols": 32}  # two chunks a row
    trace = new_trace(4, "cpu")
    plain = layer.fused("silu", new_counters("cpu"), config=cfg, programs=3)
    traced = decode_tail(
        *layer.operands(), EPS, "silu", new_counters("cpu"), layer.ple, layer.scale, layer.next, cfg, 3,
        trace=trace,
    )  # fmt: skip
    assert torch.equal(plain[0], traced[0]) and torch.equal(plain[1], traced[1])
    sizes = {"o": h // 16, "n1": 2 * m, "n1b": 2 * m, "a": i // 16, "b": h // 16, "n2": 2 * m}
    if with_ple:
        sizes |= {"g": 1, "p": h // 16, "n3": 2 * m, "n3b": 2 * m}
    else:
        sizes |= {"n2b": 2 * m}
    ends, end = [], 0
    for phase in TRACE_PHASES:
        end += sizes.get(phase, 0)
        ends.append(end if phase in sizes else -1)
    assert trace[:3, 0, 1].tolist() == [0, 1, 2]  # the start: each program's index
    first = trace[0, 1:, 1].tolist()
    assert first[0] == 0 and first[1:-1] == ends
    assert first[-1] == end  # its grab's next ticket: no more taken from the counter
    past = -(-end // 2) * 2  # tickets come 2 a grab
    for program in (1, 2):
        tickets = trace[program, 1:, 1].tolist()
        assert tickets[0] >= past and tickets[1:-1] == [tickets[0] if e >= 0 else -1 for e in ends]
    assert torch.isin(trace[:3, :, 0], torch.tensor([0, -1])).all()  # no clock here
    assert trace[3].eq(-1).all()  # beyond the grid


def test_refuses_what_it_is_not_built_for():
    layer = Layer(9, 64, 32, 96, 16, torch.float32, seed=5)
    with pytest.raises(AssertionError):  # nine rows: more than a decode batch of the kernel
        layer.fused("silu", new_counters("cpu"))
    with pytest.raises(AssertionError):  # counters of another dtype
        Layer(2, 64, 32, 96, 16, torch.float32, seed=5).fused(
            "silu", torch.zeros(COUNTERS * COUNTER_STRIDE, dtype=torch.int64)
        )


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize(
    "dims,dtype",
    [
        ((2560, 2048, 10240, 256), torch.bfloat16),
        ((2560, 4096, 10240, 256), torch.bfloat16),
        ((5376, 8192, 21504, 0), torch.bfloat16),
        ((64, 32, 96, 16), torch.float32),  # a tiny checkpoint in fp32, as the GPU engine test runs it
    ],
    ids=["e4b", "e4b-global", "31b", "tiny-fp32"],
)
def test_kernel_compiles_for_sm90(monkeypatch, m, dims, dtype):
    from test_kv_fp8_sm90_compile import _compile

    fn, args, kwargs = _meta_launch(monkeypatch, dims, m, dtype, programs=264)
    # as on a CUDA device: the counters read by ld.acquire (meta tensors launch the interpreter's form)
    compiled = _compile(fn, args, kwargs | {"ASM": True}, use_pdl=True)
    assert "ld.global.acquire.gpu.b32" in compiled.asm["ptx"]


E4B_SLIDING = (2560, 2048, 10240, 256)


def _meta_launch(monkeypatch, dims, m=1, dtype=torch.bfloat16, act="gelu_pytorch_tanh", **kwargs):
    """(kernel, args, meta) of the one launch ``decode_tail`` makes for a tail of ``dims`` (H, Q, I, P; no
    PLE where P is 0) at ``m`` rows, on meta tensors (132 SMs; the per-layer input a strided slice, as the
    model passes it), with ``kwargs`` passed on."""
    from test_kv_fp8_sm90_compile import _launches

    h, q, i, p = dims

    def t(*shape):
        return torch.empty(*shape, dtype=dtype, device="meta")

    monkeypatch.setattr(decode_tail_module, "sm_count", lambda index: 132)
    counters = torch.empty(COUNTERS * COUNTER_STRIDE, dtype=torch.int32, device="meta")
    ple = PerLayerInput(t(p, h), t(h, p), t(m, 42, p)[:, 3], t(h)) if p else None
    weights = TailWeights(t(h, q), t(h), t(h), t(2 * i, h), t(h, i), t(h))
    (launch,) = _launches(
        monkeypatch,
        decode_tail_module,
        "_decode_tail",
        lambda: decode_tail(t(m, q), t(m, h), weights, EPS, act, counters, ple, t(1), t(h), **kwargs),
    )
    return launch


def test_traced_kernel_reads_the_gpu_clock_on_sm90(monkeypatch):
    from test_kv_fp8_sm90_compile import _compile

    trace = torch.empty(264, TRACE_SLOTS, 2, dtype=torch.int64, device="meta")
    fn, args, kwargs = _meta_launch(monkeypatch, E4B_SLIDING, act="silu", programs=264, trace=trace)
    assert kwargs["TRACE"]
    ptx = _compile(fn, args, kwargs | {"ASM": True}, use_pdl=True).asm["ptx"]
    assert ptx.count("%globaltimer") >= TRACE_SLOTS - 1  # start, first ticket, the phase ends, exit


def _ptxas_registers(ptx: str) -> int:
    """Registers a thread of the sm_90a build of ``ptx`` (``ptxas -v``, Triton's bundled ptxas)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/kernel.ptx"
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", f"{tmp}/kernel.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return int(re.search(r"Used (\d+) registers", log).group(1))


def test_one_row_default_fits_its_programs_per_sm(monkeypatch):
    """At one row the kernel streams weights only as fast as the bytes it keeps in flight, so its default
    grid (``programs_per_sm`` programs of ``num_warps`` warps on every SM) must fit an SM's 64K registers:
    the first version needed ~250 registers a thread and one program per SM streamed 1.4 TB/s (H200). At
    e4b's sliding tail, the largest."""
    from test_kv_fp8_sm90_compile import _compile

    cfg = decode_tail_module.decode_tail_config(1, *E4B_SLIDING)
    fn, args, kwargs = _meta_launch(monkeypatch, E4B_SLIDING)
    registers = _ptxas_registers(_compile(fn, args, kwargs | {"ASM": True}, use_pdl=True).asm["ptx"])
    allocated = -(-registers // 8) * 8  # per thread, in the allocator's units
    assert cfg["programs_per_sm"] * cfg["num_warps"] * 32 * allocated <= 65536, registers
    # and whatever another Triton's compiler would take: the cap (the H100's 3.6 build took more)
    assert registers <= cfg["max_registers"]
    assert cfg["programs_per_sm"] * cfg["num_warps"] * 32 * cfg["max_registers"] <= 65536


def test_max_registers_caps_the_build(monkeypatch):
    """A config's ``max_registers`` reaches ptxas as ``.maxnreg``: a grid of ``programs_per_sm`` programs
    then fits an SM whatever registers the compiler would take (here a cap under the default's 64)."""
    from test_kv_fp8_sm90_compile import _compile

    cfg = decode_tail_module.decode_tail_config(1, *E4B_SLIDING) | {"max_registers": 48}
    fn, args, kwargs = _meta_launch(monkeypatch, E4B_SLIDING, config=cfg)
    ptx = _compile(fn, args, kwargs | {"ASM": True}, use_pdl=True).asm["ptx"]
    assert ".maxnreg 48" in ptx
    assert _ptxas_registers(ptx) <= 48


def test_applies_only_where_the_kernel_is_built_for(monkeypatch):
    """``layers.fused.decode_tail_applies``: on (G4SERVE_DECODE_TAIL), CUDA, 1-8 rows with a unit last
    stride, plain bias-free projections and a counter buffer; anything else keeps the separate ops."""
    import g4serve.layers.fused as fused
    from g4serve.layers.fused import decode_tail_applies
    from g4serve.layers.quant import QuantLinear
    from g4serve.quant_config import WeightQuant

    plain = [torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 16, bias=False)]
    x, counters = torch.randn(3, 16), new_counters("cpu")
    assert not decode_tail_applies(x, plain, counters)  # off by default
    monkeypatch.setattr(fused, "DECODE_TAIL", True)
    assert not decode_tail_applies(x, plain, counters)  # not CUDA
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert decode_tail_applies(x, plain, counters)
    assert decode_tail_applies(x.bfloat16(), plain, counters)
    assert not decode_tail_applies(x, plain, None)  # no counters: not prepared for the fast path
    assert not decode_tail_applies(torch.randn(9, 16), plain, counters)  # past a decode batch
    assert not decode_tail_applies(x[:0], plain, counters)
    assert not decode_tail_applies(torch.randn(16, 3).T, plain, counters)  # strided rows
    assert not decode_tail_applies(x, [*plain, torch.nn.Linear(16, 8)], counters)  # a bias
    quantized = QuantLinear(16, 8, WeightQuant("fp8", "channel", (1, 0)))
    assert not decode_tail_applies(x, [quantized, plain[1]], counters)  # quantized weights
