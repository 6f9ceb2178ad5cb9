"""The L2 prefetch: its launch arithmetic, its sm_90 build, and the plan of what a decode step asks for
(tests/models/test_prefetch_plan.py: the plan over real layers).

The kernel itself has no result to compare (it only warms L2) and uses inline PTX the interpreter cannot run:
the GPU tests check that it runs, eagerly and captured, and changes no output
(tests/gpu/test_l2_prefetch_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels import l2_prefetch as kernel
from g4serve.layers import prefetch

MB = 1 << 20


def test_clip_keeps_the_tensors_own_aligned_bytes():
    t = torch.empty(1000, dtype=torch.bfloat16)  # 2,000 bytes
    base = t.data_ptr()
    assert base % 16 == 0
    assert kernel.clip(t, 0, 4096) == (base, 2000 - 2000 % 16)  # past the end: cut at the tensor's last 16
    assert kernel.clip(t, 3, 100) == (base + 16, 80)  # [3, 103) shrunk inward to [16, 96)
    assert kernel.clip(t, 1990, 100) is None  # nothing aligned left
    assert kernel.clip(t, -5, 32) == (base, 16)  # [-5, 27) within the tensor: [0, 27), aligned [0, 16)


def test_launch_gives_every_chunk_a_lane():
    grid, args, meta = kernel.launch_args(
        [(1 << 40, 24 * MB), (2 << 40, 1 * MB)], bulk=True, chunk=None, lanes=32
    )
    assert meta["CHUNK"] == 1 << 16 and meta["num_warps"] == 1 and meta["BULK"]
    # 24 MB in 64 KB chunks: 384 lanes, 12 programs of 32; the second range uses the first program only
    assert grid == (12, 2)
    assert args == [1 << 40, 24 * MB, 2 << 40, 1 * MB, 0, 0, 0, 0]
    assert kernel.launch_args([(16, 4097)], bulk=False, chunk=None, lanes=128)[0] == (1, 1)
    assert kernel.launch_shape([4096 * 128 + 1], 4096, 128) == (2, 1)
    with pytest.raises(ValueError, match="at most 4"):
        kernel.launch_args([(16, 16)] * 5, True, None, 32)


def test_prefetch_skips_cpu_tensors():
    kernel.l2_prefetch([(torch.ones(64), 0, 256)])  # nothing to warm on the CPU: no launch, no error


@pytest.mark.parametrize("bulk", [True, False])
def test_kernel_compiles_for_sm90(bulk):
    """Both forms build to an sm_90 cubin with dependent launch, as the wrapper launches them (the interpreter
    cannot run inline PTX, so this is the check the CPU machine can make of the kernel)."""
    from test_kv_fp8_sm90_compile import _compile

    grid, args, meta = kernel.launch_args(
        [(0x7F0000000000, 24 * MB), (0x7F0010000010, 3 * MB)], bulk, None, 32 if bulk else 128
    )
    _compile(kernel._l2_prefetch_kernel, args, meta | {"USE_PDL": False}, use_pdl=True)


def _stream(*sizes_mb: float) -> list[torch.Tensor]:
    return [torch.empty(int(s * MB), dtype=torch.uint8) for s in sizes_mb]


def _spans(regions):
    return [(t.numel() // MB, off / MB, n / MB) for t, off, n in regions]


def test_plan_asks_for_each_byte_once_up_to_the_budget():
    stream = _stream(16, 10, 100, 50, 1, 1, 16, 10, 100)
    points = [prefetch.Point("attn0", 0), prefetch.Point("mlp0", 2), prefetch.Point("tail0", 4)]
    points += [prefetch.Point("attn1", 6), prefetch.Point("mlp1", 8)]
    regions = prefetch.plan(stream, points, 24 * MB)
    # before q/k/v: all of it and the first 8 MB of o_proj
    assert _spans(regions["attn0"]) == [(16, 0, 16), (10, 0, 8)]
    # after o_proj: gate/up's first 24 MB (o_proj's last 2 MB lie behind this point: never asked for)
    assert _spans(regions["mlp0"]) == [(100, 0, 24)]
    # after down: the PLE weights and the next layer's q/k/v and o_proj up to 24 MB past the PLE gate
    assert _spans(regions["tail0"]) == [(1, 0, 1), (1, 0, 1), (16, 0, 16), (10, 0, 6)]
    # the next layer's q/k/v point only adds what the tail point left of its window
    assert _spans(regions["attn1"]) == [(10, 6, 2)]
    assert _spans(regions["mlp1"]) == [(100, 0, 24)]


def test_plan_stops_at_four_tensors_and_steps_over_empty_ones():
    stream = _stream(1, 0, 1, 1, 1, 1, 1)
    regions = prefetch.plan(stream, [prefetch.Point("a", 0), prefetch.Point("b", 1)], 10 * MB)
    assert _spans(regions["a"]) == [(1, 0, 1)] * 4  # tensors 0, 2, 3, 4: the window stops at four
    assert _spans(regions["b"]) == [(1, 0, 1)] * 2  # the rest of b's window: tensors 5 and 6


def test_unknown_points_are_refused(monkeypatch):
    monkeypatch.setattr(prefetch, "MODE", "line")
    monkeypatch.setattr(prefetch, "POINTS", ("attn", "norm"))
    with pytest.raises(ValueError, match="G4SERVE_L2_PREFETCH_AT: unknown points \\['norm'\\]"):
        prefetch.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(prefetch, "MODE", "0")
    assert not prefetch.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(prefetch, "MODE", "line")
    assert not prefetch.enabled(torch.device("cpu"))
