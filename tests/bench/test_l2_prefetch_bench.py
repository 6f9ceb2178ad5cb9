"""bench/l2_prefetch.py on the CPU: the prefetch kernel's launch arithmetic, sm_90 builds of it and of the
spin kernel (the interpreter cannot run inline PTX), and the script's refusal without CUDA. On an H100 the
kernel ran eagerly and from captured graphs and left the engine's greedy tokens as they were (the GPU tests
at the commits docs/benchmarks.md names)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_script

kernel = load_script("l2_prefetch")

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
    _compile = _sm90_compiler()
    grid, args, meta = kernel.launch_args(
        [(0x7F0000000000, 24 * MB), (0x7F0010000010, 3 * MB)], bulk, None, 32 if bulk else 128
    )
    _compile(kernel._l2_prefetch_kernel, args, meta | {"USE_PDL": False}, use_pdl=True)
    _compile(kernel._spin_kernel, (8000,), {"USE_PDL": False, "num_warps": 1}, use_pdl=True)


def _sm90_compiler():
    """tests/kernels' sm_90 build helper (its directory is on the path when pytest collected it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    try:
        from test_kv_fp8_sm90_compile import _compile
    finally:
        sys.path.pop(0)
    return _compile


def test_the_script_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
