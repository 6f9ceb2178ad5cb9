"""The decode GEMMs' L2 prefetch (``_launch.prefetch_rows``, ``G4SERVE_PREFETCH_BYTES``) and the
dependent-launch trigger's place (``G4SERVE_PDL_TRIGGER``): which launches prefetch, and, compiled for sm_90,
that each kernel issues its prefetches before it waits on the previous kernel and triggers its successor
where the setting says. The GPU side (the same bits with and without) is tests/gpu/test_prefetch_gpu.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import g4serve.kernels._launch as launch_module
import g4serve.kernels.fp8_matmul as fp8_module
import g4serve.kernels.gemv as gemv_module
from g4serve.kernels._launch import prefetch_bytes
from g4serve.kernels.fp8_matmul import fp8_matmul, fp8_matmul_config, one_row_config
from g4serve.kernels.gemv import GATE_UP, PLAIN, skinny_matmul


class _FakeCuda:
    """What ``prefetch_bytes`` reads of a weight: its address and device."""

    def __init__(self, address: int, is_cuda: bool = True):
        self._address, self.is_cuda = address, is_cuda

    def data_ptr(self) -> int:
        return self._address


def test_prefetch_bytes_only_for_aligned_cuda_rows_behind_a_wait(monkeypatch):
    monkeypatch.setattr(launch_module, "PREFETCH_BYTES", 1000)
    assert prefetch_bytes(_FakeCuda(4096), 5376, use_pdl=True) == 992  # rounded down to 16 bytes
    assert prefetch_bytes(_FakeCuda(4096), 5376, use_pdl=False) == 0  # nothing to overlap
    assert prefetch_bytes(_FakeCuda(4104), 5376, use_pdl=True) == 0  # rows off 16-byte boundaries
    assert prefetch_bytes(_FakeCuda(4096), 5380, use_pdl=True) == 0
    assert prefetch_bytes(_FakeCuda(4096, is_cuda=False), 5376, use_pdl=True) == 0  # the interpreter
    assert prefetch_bytes(torch.empty(4, 64), 256, use_pdl=True) == 0
    monkeypatch.setattr(launch_module, "PREFETCH_BYTES", 0)
    assert prefetch_bytes(_FakeCuda(4096), 5376, use_pdl=True) == 0


def _gemm_launches(monkeypatch, epilogue: int) -> list:
    """The launches of the three decode GEMM kernels at 31B's o shape: the W8A8 GEMM on the tensor cores and
    on the CUDA cores, the bf16 skinny GEMM at one and eight rows."""
    from test_kv_fp8_sm90_compile import _launches

    n, k = 5376, 8192
    rows = 2 * n if epilogue == GATE_UP else n
    act = "gelu_pytorch_tanh" if epilogue != PLAIN else None
    x1, x8 = (torch.empty(m, k, dtype=torch.bfloat16, device="meta") for m in (1, 8))
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device="meta")
    scale = torch.empty(rows, 1, device="meta")
    w = torch.empty(rows, k, dtype=torch.bfloat16, device="meta")
    mma = fp8_matmul_config(1, n, k, 132, one_row="mma", epilogue=epilogue)
    found = []
    found += _launches(monkeypatch, fp8_module, "_quantize_groups _fp8_matmul _fp8_gemv",
                       lambda: [fp8_matmul(x1, q, scale, (1, k), epilogue, act, None, cfg)
                                for cfg in (mma, one_row_config(n, k, epilogue))])  # fmt: skip
    found += _launches(monkeypatch, gemv_module, "_gemv",
                       lambda: [skinny_matmul(x, w, epilogue, act) for x in (x1, x8)])  # fmt: skip
    return found


def _orders(epilogue: int) -> list[tuple[str, list[str]]]:
    """(kernel, its prefetches, waits and triggers in PTX order) of each decode GEMM compiled for sm_90 with a
    prefetch, under this process's ``G4SERVE_PDL_TRIGGER``."""
    from test_kv_fp8_sm90_compile import _compile

    orders = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        launches = [launch for launch in _gemm_launches(monkeypatch, epilogue) if "PREFETCH" in launch[2]]
    assert len(launches) == 4  # (not the quantizer)
    for fn, args, kwargs in launches:
        assert kwargs["PREFETCH"] == 0  # meta tensors: not CUDA
        kwargs = kwargs | {"PREFETCH": 1024} | ({"PTX": True} if "PTX" in kwargs else {})
        ptx = _compile(fn, args, kwargs, use_pdl=True).asm["ptx"]
        orders.append((fn.__name__, re.findall(_EVENTS, ptx)))
    return orders


_EVENTS = r"cp\.async\.bulk\.prefetch\.L2|griddepcontrol\.wait|griddepcontrol\.launch_dependents"


@pytest.mark.parametrize("trigger", ["after_wait", "first"])
@pytest.mark.parametrize("epilogue", [PLAIN, GATE_UP])
def test_prefetch_comes_before_the_wait_when_compiled_for_sm90(trigger, epilogue):
    """Compiled in a fresh process for each ``G4SERVE_PDL_TRIGGER`` (a constexpr global, read when a kernel is
    first compiled)."""
    code = f"import json, test_prefetch; print(json.dumps(test_prefetch._orders({epilogue})))"
    env = os.environ | {"G4SERVE_PDL_TRIGGER": trigger}
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if "cannot reach ptxas" in done.stdout + done.stderr:
        pytest.skip("Triton cannot reach ptxas here")
    assert done.returncode == 0, done.stderr[-3000:]
    prefetches = ["cp.async.bulk.prefetch.L2"] * (2 if epilogue == GATE_UP else 1)  # (gate and up rows)
    signal, wait = ["griddepcontrol.launch_dependents"], ["griddepcontrol.wait"]
    expected = prefetches + (signal + wait if trigger == "first" else wait + signal)
    for name, order in json.loads(done.stdout.strip().splitlines()[-1]):
        assert order == expected, (name, order)
