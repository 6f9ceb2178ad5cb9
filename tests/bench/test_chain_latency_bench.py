"""bench/chain_latency.py on the CPU: every item runs (Triton's interpreter, tiny shapes of the preset's
structure), a pair alternates the projection with the kernel it is paired with, and the report subtracts."""

from __future__ import annotations

import argparse

import torch
from bench_scripts import load_script

bench = load_script("chain_latency")


def test_items_and_pairs():
    args = argparse.Namespace(stream_mb=1, context=40, graph_context=4096)
    s = bench.shapes("e4b", "cpu")
    items = bench.build_items(s, "fp8", args, "cpu", torch.float32)
    assert set(items) == {
        "o_proj",
        "norm",
        "quantize",
        "o_proj+norm",
        "o_proj+quantize",
        "o_proj>norm",
        "decode",
    }
    calls, per_item = items["o_proj+norm"]
    assert per_item == 2 and len(calls) == 2 * len(items["o_proj"][0])
    assert calls[1] is items["norm"][0][0] and calls[0] is items["o_proj"][0][0]
    out, _ = calls[1]()
    assert out.shape == (1, s["hidden"]) and torch.isfinite(out).all()
    assert items["decode"][0][0]().shape == (1, s["q_heads"], s["head_dim"])
    assert "quantize" not in bench.build_items(s, "none", args, "cpu", torch.float32)


def test_main_reports_each_pair_against_its_projection(capsys):
    argv = ["--device", "cpu", "--presets", "e4b", "--quantization", "none", "--context", "24"]
    assert bench.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("e4b none: us an item: o_proj ") and "after o_proj: norm " in line


def test_timeline_prints_each_kernel_against_the_previous_end(capsys):
    timeline = [{"name": f"k{i}", "start": 10.0 * i, "end": 10.0 * i + 4.0} for i in range(6)]
    bench.print_timeline("pair", timeline)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  trace pair:"
    assert [line.split()[0] for line in lines[1:]] == ["k2", "k3"]
    assert lines[1].rstrip().endswith("+ 10.00") and " start    20.00 end    24.00" in lines[1]
