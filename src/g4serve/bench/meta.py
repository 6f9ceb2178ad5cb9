"""Where a benchmark ran: the commit of the tree and the device's name, for every result file."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from g4serve import envs


def git_commit() -> str | None:
    """$G4SERVE_GIT_COMMIT when set (a copy of the tree whose .git is missing or stale, as on the device
    machine), else HEAD of the g4serve checkout (``+dirty`` with local changes)."""
    if envs.get("G4SERVE_GIT_COMMIT"):
        return envs.get("G4SERVE_GIT_COMMIT")
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str | None = None) -> str:
    """The GPU's name (torch.cuda) when one is used or available, else the CPU model from /proc/cpuinfo."""
    if device is None or device.startswith("cuda"):
        name = _cuda_name(device)
        if name:
            return name
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}"


def _cuda_name(device: str | None) -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = torch.device(device).index if device and ":" in device else 0
        return f"{torch.cuda.get_device_name(index)} (x{torch.cuda.device_count()})"
    except Exception:  # noqa: BLE001 - no torch (a client-only box) or no driver: name the CPU instead
        return None


def command_line() -> str:
    """The command that is running, as a shell would take it (the interpreter by its name)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def cuda_environment() -> dict:
    """What a kernel benchmark's JSON records about where it ran (CUDA device 0)."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "git_commit": git_commit(),
        "device_name": torch.cuda.get_device_name(0),
        "device_sm_count": props.multi_processor_count,
        "torch_version": torch.__version__,
        "triton_version": triton.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "command": command_line(),
        "timestamp_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "switches": envs.recorded(),
    }


def kernel_result_path(out_dir: str | Path, bench: str, env: dict, preset: str, suffix: str = "") -> Path:
    """``<out_dir>/<bench>_<local time>_<device>_<preset><suffix>.json`` (the folder is created): where a
    kernel benchmark (bench/gemv_kernels.py, fp8_matmul_tiles.py, lora_kernel.py, moe_kernels.py) writes
    its JSON; ``env`` is ``cuda_environment()``'s."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    device = env["device_name"].lower().replace(" ", "-")
    return out / f"{bench}_{stamp}_{device}_{preset}{suffix}.json"


def write_result_json(out_dir: str | Path, stem: str, result: dict) -> Path:
    """Write a benchmark's result as ``<out_dir>/<stem>-<UTC timestamp>.json`` (the folder is created),
    say so, and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{dt.datetime.now(dt.UTC).strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


def result_header(benchmark: str, device: str | None = None) -> dict:
    """The fields every result file starts with: the benchmark, the commit, the device, Python, the date and
    the command that ran."""
    return {
        "benchmark": benchmark,
        "git_commit": git_commit(),
        "device": device_name(device),
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00"),
        "command": command_line(),
        "switches": envs.recorded(),
    }
