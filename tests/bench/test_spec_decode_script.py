"""`bench/spec_decode.py` on the tiny model (CPU): variants side by side in one JSON and table, MTP at forced
acceptance 1.0 yielding 1 + k tokens a step per request."""

from __future__ import annotations

import json

import pytest
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


def test_merge_puts_several_runs_in_one_table(tmp_path):
    """``--merge``: one row per (model, variant) of several runs' JSON, a column per batch any run timed."""
    script = load_script("spec_decode")

    def run(model, batches, ttft):
        decode = [{"batch": b, "itl_ms": 2.0 * b, "output_tokens_per_s": 100.0 * b} for b in batches]
        variant = {"variant": "fp8", "floor_token_ms_b1": 1.5, "decode": decode, "ttft": ttft}
        return {"model": f"/presets/{model}", "variants": [variant, {**variant, "variant": "bf16"}]}

    paths = []
    for name, doc in (("e4b", run("e4b", [1, 64], {"ttft_p50_ms": 20.0})), ("31b", run("31b", [1, 8], None))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    assert script.main(["--merge", *map(str, paths), "--out", str(tmp_path / "out")]) == 0
    (table,) = (tmp_path / "out").glob("formats-table-*.md")
    lines = table.read_text().splitlines()
    assert lines[0].startswith("| model | variant |") and "B=1 ITL" in lines[0] and "B=64 ITL" in lines[0]
    assert len(lines) == 2 + 4
    assert lines[2] == "| e4b | fp8 | 1.50 | 2.00 (100) |  | 128.00 (6400) | 20.0 ms |"
    assert lines[4] == "| 31b | fp8 | 1.50 | 2.00 (100) | 16.00 (800) |  | = |"


def test_decoding_requests_outlast_the_others_prefill_steps(tiny_model_dir):
    """Long prompts at a small token budget: the requests whose prompts finish first decode during the others'
    prefill steps. ``max_tokens`` of steps + 8 ended them before the timing began (a "B = 30" step timed
    with a dozen rows): ``start_decoding`` refuses that, and ``decode_max_tokens`` sizes it."""
    from g4serve.engine.engine import EngineConfig, LLMEngine
    from g4serve.sampling_params import SamplingParams

    bench = load_script("engine_microbench")
    config = EngineConfig(
        model=str(tiny_model_dir),
        device="cpu",
        text_only=True,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    batch, prompt_len, steps = 3, 160, 3
    short = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="ended before the timed steps"):
        bench.start_decoding(engine, batch, prompt_len, short, "short")
    for rid in list(engine.requests):
        engine.abort_request(rid)
    max_tokens = bench.decode_max_tokens(engine, batch, prompt_len, steps)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    bench.start_decoding(engine, batch, prompt_len, params, "sized")
    before = engine.num_generated_tokens
    bench.timed_steps(engine, steps)
    assert engine.num_generated_tokens - before == batch * steps  # every row decoded every timed step
