"""bench/decode_tail.py on the CPU: the tail shapes it times per preset, its sweep's tiles (a sample, run in
Triton's interpreter against the torch reference at a tiny shape) and its refusal without CUDA."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_script

from g4serve.config import PRESETS
from g4serve.kernels.decode_tail import (
    TRACE_SLOTS,
    PerLayerInput,
    TailWeights,
    decode_tail,
    decode_tail_config,
    decode_tail_reference,
    new_counters,
    new_trace,
)

bench = load_script("decode_tail")


@pytest.mark.parametrize("preset", ["e2b", "e4b", "31b"])
def test_shapes_cover_every_dense_layer(preset):
    text = PRESETS[preset]().text
    shapes = bench.tail_shapes(preset)
    assert sum(n for *_, n, _ in shapes) == text.num_hidden_layers
    layers = range(text.num_hidden_layers)
    assert {(q, i) for _, q, i, *_ in shapes} == {
        (text.num_attention_heads * text.layer_head_dim(k), text.layer_intermediate_size(k)) for k in layers
    }
    p = text.hidden_size_per_layer_input or 0
    assert all(row[0] == text.hidden_size and row[3] == p for row in shapes)


def test_moe_presets_have_no_tail_the_kernel_serves():
    assert bench.tail_shapes("26b-a4b") == []


TINY = (48, 32, 80, 16)  # a tiny tail's H, Q, I, P (with PLE)


def _tiny_tail(m: int, seed: int):
    """(attn, residual, weights), the PLE end and a next norm of the tiny tail at ``m`` rows (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    h, q, i, p = TINY

    def randn(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    weights = TailWeights(randn(h, q), 1 + randn(h), 1 + randn(h), randn(2 * i, h), randn(h, i), 1 + randn(h))
    operands = (randn(m, q), randn(m, h), weights)
    ple = PerLayerInput(randn(p, h), randn(h, p), randn(m, p), 1 + randn(h))
    return operands, ple, 1 + randn(h)


@pytest.mark.parametrize("m,grid", [(1, "full"), (8, "full"), (1, "coarse"), (1, "tickets")])
def test_swept_configs_compute_the_tail(m, grid):
    operands, ple, next_norm = _tiny_tail(m, seed=m)
    want = decode_tail_reference(*operands, 1e-6, "silu", ple, None, next_norm)
    configs = bench.tail_sweep(m, grid)
    for cfg in configs[:: max(1, len(configs) // 12)]:
        cfg = decode_tail_config(m, *TINY) | cfg
        got = decode_tail(*operands, 1e-6, "silu", new_counters("cpu"), ple, None, next_norm, cfg)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=3e-5, rtol=3e-5, msg=str(cfg))


def test_the_coarse_grid_tries_gemv_like_parallelism():
    coarse = bench.tail_sweep(1, "coarse")
    assert len(coarse) == 36 and len(bench.tail_sweep(1)) == 486
    assert {c["programs_per_sm"] for c in coarse} == {4, 8, 12} and {c["num_warps"] for c in coarse} == {4}
    assert all(c["bn_o"] == c["bn_b"] <= 4 for c in coarse)
    assert bench.tail_sweep(8, "coarse") == bench.tail_sweep(8)  # more rows: the full grid


def test_the_tickets_grid_varies_the_grab_and_the_norm_chunks():
    tickets = bench.tail_sweep(1, "tickets")
    assert {c["grab"] for c in tickets} == {1, 2, 4, 8} and {c["norm_cols"] for c in tickets} == {256, 1024}
    assert len(tickets) == 8 and all(set(c) == {"grab", "norm_cols"} for c in tickets)  # the rest: default


def test_the_timeline_reads_each_phase_from_its_last_program():
    trace = torch.full((5, TRACE_SLOTS, 2), -1, dtype=torch.int64)
    t0 = 10_000_000
    # a tail without PLE or a next norm: start, first ticket, then o, n1, n1b, a, b, n2 (slots 2-7). Program 0
    # starts first; program 1 1 us later; program 3 only once program 0 has left (the SMs held 3 at once);
    # program 4 was never launched (fewer tasks than programs)
    trace[0, :8, 0] = torch.tensor([0, 200, 3_000, 3_000, 3_100, 9_000, 9_000, 9_500]) + t0
    trace[1, :8, 0] = torch.tensor([1_000, 1_300, 2_000, 5_000, 5_400, 6_000, 12_000, 14_000]) + t0
    trace[2, :8, 0] = torch.tensor([500, 600, 2_500, 5_200, 5_300, 7_000, 12_100, 12_200]) + t0
    trace[3, :8, 0] = torch.tensor([9_700, 9_800] + [9_800] * 6) + t0
    trace[:4, :8, 1] = 0
    trace[:4, -1, 0] = torch.tensor([9_600, 14_500, 12_300, 9_900]) + t0
    trace[:4, -1, 1] = 0
    timeline = bench.trace_timeline(trace, 5)
    assert timeline["programs"] == 4 and timeline["start_spread_us"] == 9.7
    assert timeline["first_ticket_us"] == 9.8 and timeline["max_resident"] == 3
    assert [p["phase"] for p in timeline["phases"]] == ["o", "n1", "n1b", "a", "b", "n2"]
    assert [p["last_out_us"] for p in timeline["phases"]] == [9.8, 9.8, 9.8, 9.8, 12.1, 14.0]
    assert [p["first_out_us"] for p in timeline["phases"]] == [2.0, 3.0, 3.1, 6.0, 9.0, 9.5]
    assert [p["critical_us"] for p in timeline["phases"]] == [9.8, 0.0, 0.0, 0.0, 2.3, 1.9]
    assert timeline["last_exit_us"] == 14.5
    # without the late program the phases' own ends show
    timeline = bench.trace_timeline(trace[[0, 1, 2, 4]], 4)
    assert timeline["max_resident"] == 3 and timeline["start_spread_us"] == 1.0
    assert [p["last_out_us"] for p in timeline["phases"]] == [3.0, 5.2, 5.4, 9.0, 12.1, 14.0]
    assert [p["critical_us"] for p in timeline["phases"]] == [3.0, 2.2, 0.2, 3.6, 3.1, 1.9]


def test_a_traced_interpreter_launch_makes_a_timeline():
    operands, ple, _ = _tiny_tail(1, seed=2)
    trace = new_trace(5, "cpu")
    decode_tail(*operands, 1e-6, "silu", new_counters("cpu"), ple, trace=trace)
    timeline = bench.trace_timeline(trace, 5)  # the interpreter's grid: 3 programs, no clock
    # with PLE and no next norm: every phase but n2b and n3b
    assert timeline["programs"] == 3 and [p["phase"] for p in timeline["phases"]] == [
        "o",
        "n1",
        "n1b",
        "a",
        "b",
        "n2",
        "g",
        "p",
        "n3",
    ]
    assert all(p["last_out_us"] == 0 for p in timeline["phases"])


def test_refuses_to_run_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--presets", "e4b"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
