"""``POST /start_profile`` and ``POST /stop_profile`` (engine/torch_profile.py): off (404) unless
``G4SERVE_TORCH_PROFILER_DIR`` is set; then a profile of the engine thread's steps written as a Chrome trace
and an ops table; a second start or a stop without a start is the client's error; the API key guards them;
a forgotten profile stops itself."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from g4serve.engine.torch_profile import ProfileError, TorchProfile

USER = [{"role": "user", "content": "my balance please"}]


def _trace_summary():
    path = Path(__file__).resolve().parents[2] / "bench" / "trace_summary.py"
    spec = importlib.util.spec_from_file_location("trace_summary", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_summary"] = module  # its dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def _chat(base_url: str, headers: dict | None = None) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 3}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_profiling_is_off_without_the_directory(server):
    for route in ("/start_profile", "/stop_profile"):
        r = httpx.post(f"{server.base_url}{route}")
        assert r.status_code == 404 and "G4SERVE_TORCH_PROFILER_DIR" in r.json()["error"]["message"]


def test_a_profile_of_served_steps(tiny_model_dir, server_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("G4SERVE_TORCH_PROFILER_DIR", str(tmp_path / "prof"))
    running = server_factory(tiny_model_dir, "--served-model-name", "tiny", "--api-key", "k")
    base, auth = running.base_url, {"Authorization": "Bearer k"}
    assert httpx.post(f"{base}/start_profile").status_code == 401  # the API key guards it
    r = httpx.post(f"{base}/stop_profile", headers=auth)
    assert r.status_code == 400 and "none is running" in r.json()["error"]["message"]
    assert httpx.post(f"{base}/start_profile", headers=auth).json() == {"status": "profiling"}
    r = httpx.post(f"{base}/start_profile", headers=auth)
    assert r.status_code == 400 and "running already" in r.json()["error"]["message"]
    _chat(base, auth)
    r = httpx.post(f"{base}/stop_profile", headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    files = r.json()
    assert files["status"] == "stopped"
    trace = json.loads(gzip.open(files["trace"]).read())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)  # the step's ops, recorded on the engine thread
    assert "Name" in open(files["table"]).read()
    # with Python stacks (the default), bench/trace_summary.py finds the engine thread's steps by function
    functions = [name for t in _trace_summary().summarize(trace, min_busy_ms=0) for name in t.inclusive]
    assert any("engine/engine.py(" in name and name.endswith(": step") for name in functions)
    _chat(base, auth)  # the engine serves on
    assert running.app.state.engine.profiler.running is False


def test_a_forgotten_profile_stops_itself(tmp_path):
    profile = TorchProfile(tmp_path, max_seconds=0.05)
    profile.step()  # nothing running: nothing happens
    profile.start()
    profile.step()
    assert profile.running
    time.sleep(0.1)
    profile.step()
    assert not profile.running and profile.last is not None
    assert (tmp_path / profile.last["table"]).exists()
    with pytest.raises(ProfileError):
        profile.stop()
