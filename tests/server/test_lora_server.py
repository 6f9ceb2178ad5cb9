"""LoRA adapters over HTTP, driven by the official openai client: ``--lora-modules``, the ``model`` field
selecting an adapter per request, ``/v1/models``, and run-time load/unload behind the API key and
``--lora-root``."""

from __future__ import annotations

import concurrent.futures
import shutil

import httpx
import pytest

from g4serve import LLM, SamplingParams

openai = pytest.importorskip("openai")

KEY = "lora-test-key"
PROMPTS = ["what is my balance", "send forty dollars to maria tomorrow", "hello there"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(lora_adapter, server_factory, tmp_path_factory):
    """A server on the base checkpoint with adapter "all" from the start and run-time loading under a root
    holding "qv" and "mlp"; the greedy answers of the base and merged models."""
    base, all_dir, _ = lora_adapter("all")
    root = tmp_path_factory.mktemp("lora-root")
    for name in ("qv", "mlp"):
        shutil.copytree(lora_adapter(name)[1], root / name)
    running = server_factory(
        base,
        "--served-model-name",
        "base",
        "--api-key",
        KEY,
        "--lora-modules",
        f"all={all_dir}",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--lora-root",
        str(root),
        "--text-only",
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {}
    for name in (None, "all", "qv", "mlp"):
        path = lora_adapter(name)[2] if name else base
        llm = LLM(path, device="cpu", text_only=True, kv_cache_bytes=16 << 20)
        expected[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=KEY, max_retries=0)
    return running, root, client, expected


def _complete(client, model: str, prompt: str) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def _post(running, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{running.base_url}{path}", json=body, headers=headers, timeout=60)


def test_models_lists_the_adapters(setup):
    _, _, client, _ = setup
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "all"}
    assert models["all"].parent == "base" and models["base"].parent is None


def test_model_field_selects_the_adapter(setup):
    _, _, client, expected = setup
    assert expected["all"] != expected[None]
    assert [_complete(client, "all", p) for p in PROMPTS] == expected["all"]
    assert [_complete(client, "base", p) for p in PROMPTS] == expected[None]


def test_concurrent_requests_mix_adapters_in_batches(setup):
    running, _, client, expected = setup
    jobs = [(m, i) for m in ("all", "base") for i in range(len(PROMPTS))] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(client, job[0], PROMPTS[job[1]]), jobs))
    assert got == [expected[None if m == "base" else m][i] for m, i in jobs]
    running.wait_idle()


def test_chat_streams_with_an_adapter(setup):
    _, _, client, _ = setup
    stream = client.chat.completions.create(
        model="all", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.model == "all" for c in chunks)


def test_responses_run_with_the_adapter_too(setup):
    _, _, client, _ = setup
    messages = [{"role": "user", "content": "what is my balance"}]

    def chat(model):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        return out.choices[0].message.content

    response = client.responses.create(model="all", input=messages, max_output_tokens=6, temperature=0)
    assert response.model == "all"
    assert response.output_text == chat("all") != chat("base")


def test_unknown_model_is_a_404_naming_the_field(setup):
    _, _, client, _ = setup
    with pytest.raises(openai.NotFoundError, match="model: the model 'nope' does not exist"):
        _complete(client, "nope", "hi")


def test_load_use_unload(setup):
    running, root, client, expected = setup
    assert (
        _post(running, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": "qv"}, key=None).status_code
        == 401
    )
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(root / "qv")})
    assert r.status_code == 200, r.text
    assert [_complete(client, "qv", p) for p in PROMPTS] == expected["qv"]
    # both slots are taken ("all" and "qv"): a third adapter waits for an unload
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": "mlp"})
    assert r.status_code == 400 and "all 2 adapter slots are in use" in r.json()["error"]["message"]
    assert _post(running, "/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "qv", "hi")
    r = _post(
        running, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": "mlp"}
    )  # relative to the root
    assert r.status_code == 200, r.text
    assert [_complete(client, "mlp", p) for p in PROMPTS] == expected["mlp"]
    assert _post(running, "/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    r = _post(running, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    running.wait_idle()


@pytest.mark.parametrize(
    "body,status,param,message",
    [
        ({"lora_name": "x", "lora_path": "../../../etc"}, 400, "lora_path", "under the server's --lora-root"),
        ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path", "under the server's --lora-root"),
        ({"lora_name": "x", "lora_path": "missing"}, 400, "lora_path", "is not a directory"),
        ({"lora_name": "x"}, 400, "lora_path", "expected a non-empty string"),
        ({"lora_name": "base", "lora_path": "qv"}, 400, "lora_name", "the base model's name"),
        ({"lora_name": "all", "lora_path": "qv"}, 400, "lora_name", "already loaded"),
        ({"lora_name": "a b", "lora_path": "qv"}, 400, "lora_name", "not a usable name"),
        ({"lora_name": "x", "lora_path": "qv", "extra": 1}, 400, "extra", "unknown field"),
    ],
)
def test_bad_loads_are_refused_by_field(setup, body, status, param, message):
    running, root, _, _ = setup
    r = _post(running, "/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert str(root) not in error["message"]  # the server's directories stay private


def test_a_hostile_adapter_is_refused_and_the_server_serves_on(setup):
    running, root, client, expected = setup
    bad = root / "dora"
    shutil.copytree(root / "qv", bad)
    config = (bad / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (bad / "adapter_config.json").write_text(config)
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": "dora"})
    assert r.status_code == 400 and "use_dora is not supported" in r.json()["error"]["message"]
    assert _complete(client, "all", PROMPTS[0]) == expected["all"][0]


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_file_linked_from_outside_the_root_is_refused(setup, lora_adapter, linked):
    """The adapter's directory lies under --lora-root, but a file in it may be a link: to an adapter outside
    the root (what the root is meant to keep out), or to any file the server can read (its error would
    quote a config file's parse error). Files are resolved and must lie under the root too."""
    running, root, client, expected = setup
    linking = root / f"linking-{linked.split('.')[0]}"
    shutil.copytree(root / "qv", linking)
    (linking / linked).unlink()
    (linking / linked).symlink_to(lora_adapter("mlp")[1] / linked)  # an adapter outside the root
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "linked", "lora_path": linking.name})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["param"] == "lora_path"
        and f"{linked}: lies outside the server's --lora-root" in error["message"]
    )
    assert str(root) not in error["message"] and "linked" not in [m.id for m in client.models.list().data]
    inside = (
        root / f"{linking.name}-inside"
    )  # a link that stays under the root is followed (an HF cache's blobs)
    shutil.copytree(root / "qv", inside)
    (inside / linked).unlink()
    (inside / linked).symlink_to(root / "qv" / linked)
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "inside", "lora_path": inside.name})
    assert r.status_code == 200, r.text
    assert _post(running, "/v1/unload_lora_adapter", {"lora_name": "inside"}).status_code == 200
    assert _complete(client, "all", PROMPTS[0]) == expected["all"][0]
    running.wait_idle()


def test_run_time_loading_is_off_without_lora_root(lora_adapter, server_factory):
    base, all_dir, _ = lora_adapter("all")
    running = server_factory(base, "--lora-modules", f"all={all_dir}", "--max-lora-rank", "8", "--text-only")
    r = _post(running, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(all_dir)}, key=None)
    assert r.status_code == 404 and "--lora-root" in r.json()["error"]["message"]


def test_lora_root_needs_an_api_key(lora_adapter, tmp_path, monkeypatch):
    import argparse

    from g4serve.server.launch import add_serve_arguments, build_from_args

    monkeypatch.delenv("G4SERVE_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(lora_adapter("all")[0]), "--device", "cpu", "--lora-root", str(tmp_path)])
    with pytest.raises(SystemExit, match="--lora-root needs --api-key"):
        build_from_args(args)
