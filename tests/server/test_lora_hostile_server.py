"""Run-time LoRA loading against a hostile client: paths that cannot be resolved, loads racing each other and
a full set of slots. Each is a 400 naming the field, and the server serves on with nothing leaked."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import pytest

KEY = "lora-hostile-key"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def setup(lora_adapter, server_factory, tmp_path_factory):
    """A server with two adapter slots, run-time loading under a root holding copies of "qv" and "mlp"."""
    base = lora_adapter("all")[0]
    root = tmp_path_factory.mktemp("hostile-root")
    for name in ("qv", "mlp"):
        shutil.copytree(lora_adapter(name)[1], root / name)
    running = server_factory(
        base,
        "--served-model-name",
        "base",
        "--api-key",
        KEY,
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--lora-root",
        str(root),
        "--text-only",
    )
    return running, root


def _post(running, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{running.base_url}{path}", json=body, headers=headers, timeout=60)


def _complete(running, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0}
    return _post(running, "/v1/completions", body)


def _unload_all(running) -> None:
    for name in running.engine.lora.names():
        assert _post(running, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    running.wait_idle()


@pytest.fixture
def counted_reads(setup, monkeypatch):
    """Each adapter read the engine starts, and how many ran at once at most; every read takes 0.3 s more
    (a large adapter on a slow disk)."""
    running, _ = setup
    engine = running.engine
    read = engine.read_lora
    stats = {"reads": 0, "now": 0, "most": 0}
    lock = threading.Lock()

    def slow_read(path, confine_to=None):
        with lock:
            stats["reads"] += 1
            stats["now"] += 1
            stats["most"] = max(stats["most"], stats["now"])
        try:
            time.sleep(0.3)
            return read(path, confine_to)
        finally:
            with lock:
                stats["now"] -= 1

    monkeypatch.setattr(engine, "read_lora", slow_read)
    yield stats
    _unload_all(running)


def _link_loop(root) -> str:
    (root / "loop-a").symlink_to("loop-b")
    (root / "loop-b").symlink_to("loop-a")
    return "loop-a"


@pytest.mark.parametrize(
    "make_path",
    [_link_loop, lambda root: "a" * 300, lambda root: "/".join(["d" * 200] * 30)],
    ids=["link-loop", "name-past-NAME_MAX", "path-past-PATH_MAX"],
)
def test_unresolvable_paths_are_a_400(setup, make_path):
    """A link loop raised RuntimeError from Path.resolve, and names past NAME_MAX / PATH_MAX OSError from
    is_dir: both answered 500."""
    running, root = setup
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": make_path(root)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_path" and str(root) not in error["message"]
    assert _complete(running, "base").status_code == 200


def test_a_deeply_nested_config_is_a_400(setup):
    running, root = setup
    bad = root / "deep"
    shutil.copytree(root / "qv", bad)
    (bad / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "deep", "lora_path": "deep"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "lora_path: adapter_config.json: nested too deeply"


def test_a_backtracking_alpha_pattern_is_a_400_and_requests_go_on(setup):
    """The key that would run the stdlib matcher for hours with the interpreter lock held (stopping every
    thread of the server) is refused at once."""
    running, root = setup
    bad = root / "redos"
    shutil.copytree(root / "qv", bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"(.|.)*[0-9]": 2.0}
    (bad / "adapter_config.json").write_text(json.dumps(config))
    t0 = time.monotonic()
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "redos", "lora_path": "redos"})
    assert r.status_code == 400 and "alpha_pattern" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 1.0
    assert _complete(running, "base").status_code == 200


def test_wrong_types_in_the_body_name_the_field(setup):
    running, _ = setup
    body = {"lora_name": "qv", "lora_path": "qv", "load_inplace": "yes"}
    r = _post(running, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace", r.text
    assert "qv" not in running.engine.lora.names()


async def _load_all(running, bodies: list[dict]) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=running.base_url, headers=headers, timeout=60) as client:
        return await asyncio.gather(*(client.post("/v1/load_lora_adapter", json=b) for b in bodies))


def test_loads_of_one_name_at_once_read_it_once(setup, counted_reads):
    """Four loads of the same name at once each read the adapter (in the preprocessing pool, up to its four
    workers, so no prompt could be processed meanwhile) before three were refused."""
    running, _ = setup
    responses = asyncio.run(_load_all(running, [{"lora_name": "dup", "lora_path": "qv"}] * 4))
    assert sorted(r.status_code for r in responses) == [200, 400, 400, 400]
    assert all("already loaded" in r.json()["error"]["message"] for r in responses if r.status_code == 400)
    assert counted_reads["reads"] == 1 and running.engine.lora.names() == ["dup"]


def test_loads_run_one_at_a_time_and_a_full_server_reads_nothing(setup, counted_reads):
    """Loads at once held one adapter each in memory at once (up to ~1.9 GB for 31B at rank 64); past the
    last free slot each was still read whole before it was refused."""
    running, _ = setup
    bodies = [{"lora_name": f"n{i}", "lora_path": ("qv", "mlp")[i % 2]} for i in range(4)]
    responses = asyncio.run(_load_all(running, bodies))
    assert sorted(r.status_code for r in responses) == [200, 200, 400, 400]
    full = [r.json()["error"] for r in responses if r.status_code == 400]
    assert all(e["param"] == "lora_name" and "adapter slots are in use" in e["message"] for e in full)
    assert counted_reads == {"reads": 2, "now": 0, "most": 1}
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "n9", "lora_path": "qv"})
    assert r.status_code == 400 and counted_reads["reads"] == 2  # refused before the file is opened
    # which two loads took the slots depends on the order they reached the lock (a fresh-clone run: not n0)
    loaded = [b["lora_name"] for b, r in zip(bodies, responses, strict=True) if r.status_code == 200]
    assert all(_complete(running, name).status_code == 200 for name in loaded)


def test_an_adapter_unloaded_between_admission_and_queue_is_a_client_error(setup, monkeypatch):
    """The request passed the model check, then its adapter was unloaded before the engine thread queued it:
    it fails alone, with no slot or KV block held, and should say so as a 4xx."""
    running, _ = setup
    assert (
        _post(running, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "qv"}).status_code == 200
    )
    engine = running.app.state.engine
    add = engine.add

    async def add_after_unload(request):
        await engine.unload_lora("gone")
        async for delta in add(request):
            yield delta

    monkeypatch.setattr(engine, "add", add_after_unload)
    r = _complete(running, "gone")
    monkeypatch.undo()
    running.wait_idle()
    assert running.engine.lora._slots == [None, None] and _complete(running, "base").status_code == 200
    assert "no LoRA adapter named 'gone'" in r.json()["error"]["message"]
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
