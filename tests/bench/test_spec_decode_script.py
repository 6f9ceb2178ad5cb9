"""`bench/spec_decode.py` on the tiny model (CPU): variants side by side in one JSON and table, MTP at forced
acceptance 1.0 yielding 1 + k tokens a step per request."""

from __future__ import annotations

import json

from bench_scripts import load_script


def test_variants_side_by_side(tiny_model_dir, tmp_path):
    script = load_script("spec_decode")
    argv = [
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--variants",
        "bf16,mtp@1.0",
        "--batches",
        "1,2",
    ]
    argv += ["--steps", "3", "--prefill-len", "32", "--prefill-reps", "1", "--out", str(tmp_path)]
    argv += ["--fit", "2x64", "--profile", "2"]
    assert script.main(argv) == 0
    (path,) = tmp_path.glob("spec-decode-*.json")
    result = json.loads(path.read_text())
    plain, mtp = result["variants"]
    assert [v["variant"] for v in result["variants"]] == ["bf16", "mtp@1.0"]
    assert [d["output_tokens"] for d in plain["decode"]] == [3, 6]
    assert [d["output_tokens"] for d in mtp["decode"]] == [12, 24]  # 4 tokens a step per request
    assert all(d["accepted_per_draft"] == 1.0 for d in mtp["decode"])
    assert plain["ttft"]["prompt_tokens"] == 32 and mtp["ttft"] is None
    assert mtp["step_bytes"] > mtp["weight_bytes"] == plain["weight_bytes"]
    assert "| mtp@1.0 |" in path.with_suffix(".md").read_text()
    assert mtp["profile"]["steps"] == 2 and (tmp_path / mtp["profile"]["trace"]).is_file()
    fit = plain["kv_fit"]
    assert fit["fits"] and fit["sequences"] == 2 and fit["tokens_each"] == 64
    assert all(0 < p["blocks_needed"] <= p["blocks"] for p in fit["pools"].values())


def test_kv_fit_counts_only_the_window_of_sliding_layers(tiny_model_dir):
    from g4serve.engine.engine import EngineConfig, LLMEngine

    script = load_script("spec_decode")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", text_only=True))
    window = engine.model_config.text.sliding_window
    block = engine.config.block_size
    fit = script.kv_fit(engine, 3, 100 * window)
    assert fit["pools"]["full_attention"]["blocks_needed"] == 3 * (100 * window // block)
    assert fit["pools"]["sliding_attention"]["blocks_needed"] <= 3 * (window // block + 2)
    full = engine.kv.pools["full_attention"].num_blocks
    assert not script.kv_fit(engine, full + 1, block)["fits"]
