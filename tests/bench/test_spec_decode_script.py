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
