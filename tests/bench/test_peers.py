"""The transformers peers on the tiny preset (CPU): `bench/peer_serve.py` starts `transformers serve` on an
in-memory model and `g4serve bench` drives it (no [DONE], no ignore_eos: generation_config's min_new_tokens);
`bench/peer_transformers.py` runs its rows within a time budget; the peer's padded tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

from bench_scripts import BENCH, load_script

from g4serve.bench import cli, common

MIN_NEW_TOKENS = json.dumps({"generation_config": json.dumps({"min_new_tokens": 100_000})})


def test_peer_tokenizer_is_the_tiny_one_padded(tmp_path):
    from transformers import AutoTokenizer

    from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
    from g4serve.processing.tokenizer import Tokenizer

    peer = load_script("peer_serve")
    theirs = AutoTokenizer.from_pretrained(peer.write_peer_tokenizer(tmp_path / "peer", vocab_size=1100))
    ours = Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path / "g4serve"))  # what g4serve's presets use
    assert len(theirs) == 1100
    messages = [{"role": "user", "content": "Send 40 dollars to Maria Lopez tomorrow, please."}]
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == ours.encode_chat(messages)
    assert theirs.decode([1099]).startswith("<unused")  # the padding decodes to text


def test_transformers_serve_peer_under_the_bench(tmp_path):
    for name in ("fastapi", "uvicorn", "openai", "typer"):
        pytest.importorskip(name)
    port = common.free_port()
    tokenizer_dir = tmp_path / "peer-tiny"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(BENCH / "peer_serve.py"),
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--tokenizer-dir",
            str(tokenizer_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "transformers serve did not start"
            time.sleep(0.5)
        out = tmp_path / "run"
        rc = cli.main(
            [
                "bench",
                "--workload",
                "text",
                "--prompt-tokens",
                "200",
                "--output-tokens",
                "6",
                "--rates",
                "4",
                "--num-requests",
                "3",
                "--warmup",
                "1",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--model",
                str(tokenizer_dir),
                "--no-ignore-eos",
                "--extra-body",
                MIN_NEW_TOKENS,
                "--label",
                "transformers-serve",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        assert rc == 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    result = json.loads((out / "results.json").read_text())
    (point,) = result["points"]
    assert point["errors"] == 0, point["first_errors"]
    assert point["requests_completed"] == 3 and point["server"] is None  # no /metrics
    assert point["mean_output_tokens"] == 6  # min_new_tokens held every answer to max_tokens
    assert 150 <= point["mean_prompt_tokens"] <= 250  # calibrated on the peer's own usage counts
    assert result["meta"]["load"]["extra_body"] == json.loads(MIN_NEW_TOKENS)


def test_peer_generate_rows_and_time_budget(tmp_path):
    peer = load_script("peer_transformers")
    assert (
        peer.main(
            [
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--eager-batches",
                "1",
                "--batches",
                "2",
                "--prefill-lengths",
                "16,32",
                "--decode-tokens",
                "3",
                "--reps",
                "1",
                "--time-budget-s",
                "600",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    (path,) = tmp_path.glob("peer-transformers-tiny-*.json")
    result = json.loads(path.read_text())
    assert [(r["batch"], r["compiled"]) for r in result["decode"]] == [
        (1, False),
        (2, False),
    ]  # CPU: no compile
    assert [r["prompt_tokens"] for r in result["prefill"]] == [16, 32] and not result["skipped"]
    assert all(r["ttft_p50_ms"] > 0 for r in result["prefill"])
    assert "git_commit" in result and result["transformers"] and result["decode_tokens"] == 3
    # A spent budget skips every row, and says so.
    assert (
        peer.main(
            [
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--batches",
                "1",
                "--prefill-lengths",
                "16",
                "--time-budget-s",
                "0.001",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    (path,) = (tmp_path / "b").glob("*.json")
    result = json.loads(path.read_text())
    assert not result["decode"] and not result["prefill"] and len(result["skipped"]) == 2
