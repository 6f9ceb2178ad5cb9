"""bench/decode_mlp.py on the CPU: the MLP shapes it times per preset, its sweep's tiles (a sample, run in
Triton's interpreter against the torch reference at a tiny shape) and its refusal without CUDA."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_script

from g4serve.config import PRESETS
from g4serve.kernels.decode_mlp import decode_mlp, decode_mlp_reference, new_counters

bench = load_script("decode_mlp")


@pytest.mark.parametrize("preset", ["e2b", "e4b", "31b"])
def test_shapes_cover_every_dense_layer(preset):
    text = PRESETS[preset]().text
    shapes = bench.mlp_shapes(preset)
    assert sum(n for _, _, n, _ in shapes) == text.num_hidden_layers
    assert {i for _, i, _, _ in shapes} == {
        text.layer_intermediate_size(k) for k in range(text.num_hidden_layers)
    }
    assert all(h == text.hidden_size and act == text.hidden_activation for h, _, _, act in shapes)


def test_moe_presets_have_no_block_the_kernel_serves():
    assert bench.mlp_shapes("26b-a4b") == []


@pytest.mark.parametrize("m", [1, 8])
def test_swept_configs_compute_the_block(m):
    gen = torch.Generator().manual_seed(m)
    h, i = 48, 80
    x, residual = torch.randn(m, h, generator=gen), torch.randn(m, h, generator=gen)
    gate_up, down = torch.randn(2 * i, h, generator=gen) * 0.2, torch.randn(h, i, generator=gen) * 0.2
    norm_w, next_w = 1 + 0.1 * torch.randn(h, generator=gen), 1 + 0.1 * torch.randn(h, generator=gen)
    want = decode_mlp_reference(x, residual, gate_up, down, norm_w, 1e-6, "silu", None, next_w)
    configs = bench.sweep_configs(m)
    for cfg in configs[:: max(1, len(configs) // 12)]:
        counters = new_counters("cpu")
        got = decode_mlp(x, residual, gate_up, down, norm_w, 1e-6, "silu", counters, None, next_w, cfg)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5, msg=str(cfg))


def test_refuses_to_run_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--presets", "e4b"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
