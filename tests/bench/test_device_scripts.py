"""The device scripts (bench/device/*.sh) on the CPU machine: each one parses (``bash -n``), and
``env_ab.sh`` runs end to end on the tiny model with ``SETUP=0 DEVICE=cpu`` (no wheels, no GPU): one run a
setting, each result recording the switches it ran with, the logs packed into the tarball and the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "bench" / "device").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_device_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_env_ab_runs_each_setting_with_its_switches(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    env = os.environ | {
        "SETUP": "0",
        "DEVICE": "cpu",
        "OUT": str(out),
        "RUNS": f"{tiny_model_dir}:bf16",
        "BATCHES": "1",
        "STEPS": "2",
        "PROMPT_LEN": "24",
        "SETTINGS": "base nq=G4SERVE_FP8_NORM_QUANT=1,G4SERVE_FP8_ONE_ROW=mma",
        # python3 on the path is this interpreter (the script calls python3)
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    env.pop("G4SERVE_FP8_NORM_QUANT", None)
    done = subprocess.run(
        ["bash", "bench/device/env_ab.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    switches = {}
    for path in (out / "r").glob("*/spec-decode-*.json"):
        result = json.loads(path.read_text())
        switches[path.parent.name.rsplit("-", 1)[-1]] = result["switches"]
        assert "--prompt-len 24" in result["command"]
    assert set(switches) == {"base", "nq"}
    picked = {side: (s["G4SERVE_FP8_NORM_QUANT"], s["G4SERVE_FP8_ONE_ROW"]) for side, s in switches.items()}
    assert picked == {"base": ("0", "auto"), "nq": ("1", "mma")}
    summary = (out / "summary.md").read_text()
    assert summary.count("## ") == 2 and "ITL" in summary
    with tarfile.open(out / "env_ab.tgz") as tar:
        assert sum(name.endswith(".log") for name in tar.getnames()) == 2
