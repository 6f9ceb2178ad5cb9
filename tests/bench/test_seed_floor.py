"""bench/seed_floor.py: the parameter counts by kind, the replayed schedule, attention's FLOPs and the KV
bytes against brute-force counts, and a step's floor against its own arithmetic."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script

from g4serve.config import FULL, preset
from g4serve.models.gemma4.text import Gemma4TextModel

floor = load_script("seed_floor")


def test_counts_split_the_tiny_model_parameters():
    cfg = preset("tiny").text
    counts = floor.count_parameters(cfg)
    model = Gemma4TextModel(cfg)
    assert counts.dense + counts.experts + counts.lm_head + counts.gathered == sum(
        p.numel() for p in model.parameters()
    )
    assert counts.lm_head == model.embed_tokens.weight.numel()
    assert counts.gathered == model.embed_tokens_per_layer.weight.numel() > 0


def test_moe_counts_are_the_expert_shapes():
    cfg = preset("26b-a4b").text
    counts = floor.count_parameters(cfg)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert counts.experts == cfg.num_hidden_layers * cfg.num_experts * per_expert
    assert counts.active_per_token == pytest.approx(
        counts.dense + counts.experts * cfg.top_k_experts / cfg.num_experts
    )
    assert counts.experts_touched(1) == pytest.approx(8 / 128)
    assert 0.84 < counts.experts_touched(30) < 0.86  # 1 - (120/128)^30
    assert counts.experts_touched(0) == 0.0


def test_schedule_decodes_first_then_chunks_in_order():
    steps = floor.schedule(floor.Workload(2, input_len=5, output_len=3, budget=4, max_num_seqs=64))
    C = floor.Chunk
    assert steps == [
        [C(0, 4, False, False)],
        [C(4, 1, True, False), C(0, 3, False, False)],
        [C(5, 1, True, True), C(3, 2, True, False)],
        [C(6, 1, True, True), C(5, 1, True, True)],
        [C(6, 1, True, True)],
    ]


def test_prefill_cap_applies_beside_decodes_only():
    steps = floor.schedule(floor.Workload(4, 100, 4, budget=64, max_num_seqs=64, prefill_cap=16))
    for work in steps:
        prompt = sum(c.tokens for c in work if not c.decode)
        if any(c.decode for c in work):
            assert prompt <= 16
        else:
            assert prompt <= 64
    assert any(not any(c.decode for c in w) and sum(c.tokens for c in w) == 64 for w in steps)
    # every request gets its prompt and its outputs, and nothing more
    assert sum(c.tokens for w in steps for c in w if not c.decode) == 400
    assert sum(c.samples for w in steps for c in w) == 16


def test_seats_bound_the_started_sequences():
    steps = floor.schedule(floor.Workload(6, 8, 5, budget=1000, max_num_seqs=2))
    assert max(len(w) for w in steps) == 2


def test_attention_flops_against_a_brute_force_sum():
    cfg = preset("tiny").text  # sliding window 16, full layers every third
    for start, length in [(0, 40), (5, 3), (20, 1), (10, 30)]:
        expect = 0.0
        for layer in range(cfg.num_hidden_layers):
            dim = cfg.layer_head_dim(layer)
            for p in range(start, start + length):
                keys = p + 1 if cfg.layer_types[layer] == FULL else min(p + 1, cfg.sliding_window)
                expect += 4 * cfg.num_attention_heads * dim * keys
        assert floor.attention_flops(cfg, start, length) == pytest.approx(expect)


def test_kv_bytes_write_producers_and_read_every_layer():
    cfg = preset("tiny").text  # the last two layers share earlier layers' K/V
    kv = floor.kv_layer_bytes(cfg, 2.0)
    write = read = 0.0
    for layer in range(cfg.num_hidden_layers):
        per = cfg.layer_num_kv_heads(layer) * cfg.layer_head_dim(layer) * 2.0
        per *= 1 if cfg.layer_uses_k_as_v(layer) else 2
        read += per
        write += per if layer < cfg.first_kv_shared_layer else 0.0
    assert kv[FULL][0] + kv["sliding"][0] == write < read == kv[FULL][1] + kv["sliding"][1]


def test_a_decode_step_is_its_bytes_at_the_bandwidth():
    cfg = preset("26b-a4b").text
    counts = floor.count_parameters(cfg)
    work = [floor.Chunk(2999, 1, True, True)]
    step = floor.step_cost(cfg, counts, work, floor.Peaks(tflops=989.0, tbps=4.8))
    kv = floor.kv_layer_bytes(cfg, 2.0)
    weights = 2.0 * (counts.dense + counts.lm_head + counts.experts * 8 / 128)
    kv_read = kv[FULL][1] * 3000 + kv["sliding"][1] * cfg.sliding_window
    kv_write = kv[FULL][0] + kv["sliding"][0]
    assert step.bytes == pytest.approx(weights + kv_read + kv_write)
    assert step.bound == "memory" and step.seconds == pytest.approx(step.bytes / 4.8e12)
    assert step.decodes == 1 and step.prompt_tokens == 0


def test_a_long_prompt_step_is_compute_bound():
    cfg = preset("26b-a4b").text
    counts = floor.count_parameters(cfg)
    step = floor.step_cost(cfg, counts, [floor.Chunk(0, 8192, True, False)], floor.Peaks(989.0, 4.8))
    assert step.bound == "compute" and step.seconds == pytest.approx(step.flops / 989e12)
    assert step.flops > 2 * counts.active_per_token * 8192


def test_main_writes_one_row_per_cap(tmp_path):
    report = floor.main(
        [
            "--model",
            "tiny",
            "--num-requests",
            "3",
            "--input-len",
            "40",
            "--output-len",
            "5",
            "--max-num-batched-tokens",
            "32",
            "--max-prefill-tokens-beside-decodes",
            "8",
            "32",
            "--measured",
            "1000",
            "900",
            "--out-dir",
            str(tmp_path),
        ]
    )
    (path,) = tmp_path.glob("seed_floor-h200-*.json")
    saved = json.loads(path.read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert [r["max_prefill_tokens_beside_decodes"] for r in saved["rows"]] == [8, 32]
    for row in saved["rows"]:
        assert row["total_tokens"] == 3 * 45
        assert row["total_tokens_per_s"] == pytest.approx(row["total_tokens"] / row["floor_s"])
    for row, measured in zip(saved["rows"], (1000, 900)):
        assert row["share_of_floor"] == pytest.approx(measured / row["total_tokens_per_s"])
        assert row["prompt_steps_s"] + row["decode_only_steps_s"] == pytest.approx(row["floor_s"])
    assert saved["rows"][0]["steps"] > saved["rows"][1]["steps"]  # the tighter cap takes more steps


def test_served_step_is_the_fixed_point_of_its_own_cost():
    cfg = preset("e4b").text
    counts = floor.count_parameters(cfg)
    peaks = floor.Peaks(989.0, 3.35)
    steps = [floor.served_step(cfg, counts, peaks, rate, 500, 128) for rate in (16, 64, 128)]
    for row, rate in zip(steps, (16, 64, 128)):
        assert row["sustainable"] and row["output_tokens_per_s"] == rate * 128
        t = row["step_ms"] / 1e3
        assert row["decode_rows"] == pytest.approx(rate * 128 * t)
        assert row["prompt_tokens_per_step"] == pytest.approx(rate * 500 * t)
        # the step that carries that work costs t again (within the rows' rounding)
        work = [floor.Chunk(564, 1, True, True)] * round(rate * 128 * t)
        whole, part = divmod(round(rate * 500 * t), 500)
        work += [floor.Chunk(0, 500, True, False)] * whole + [floor.Chunk(0, part, False, False)] * bool(part)
        assert floor.step_cost(cfg, counts, work, peaks).seconds == pytest.approx(t, rel=1e-4)
        # the same work as three counted chunks costs the same
        counted = [
            floor.Chunk(564, 1, True, True, round(rate * 128 * t)),
            floor.Chunk(0, 500, True, False, whole),
            floor.Chunk(0, part, False, False),
        ]
        a, b = floor.step_cost(cfg, counts, counted, peaks), floor.step_cost(cfg, counts, work, peaks)
        assert (a.decodes, a.prompt_tokens, a.bound) == (b.decodes, b.prompt_tokens, b.bound)
        assert (a.flops, a.bytes, a.seconds) == pytest.approx((b.flops, b.bytes, b.seconds))
    # more load, longer steps, more rows; at no load the weights alone
    assert steps[0]["step_ms"] < steps[1]["step_ms"] < steps[2]["step_ms"]
    alone = floor.step_cost(cfg, counts, [], peaks).seconds
    assert steps[0]["step_ms"] / 1e3 > alone


def test_a_rate_past_the_device_is_not_sustainable():
    cfg = preset("e4b").text
    counts = floor.count_parameters(cfg)
    # 1 TFLOP/s: every step's prompt tokens cost more than the step they arrived in
    row = floor.served_step(cfg, counts, floor.Peaks(1.0, 3.35), 1000.0, 500, 128)
    assert not row["sustainable"] and row["output_tokens_per_s"] is None


def test_main_runs_served_rates(tmp_path):
    report = floor.main(
        ["--model", "tiny", "--rates", "10", "1e9", "--input-len", "64", "--output-len", "8"]
        + ["--max-num-seqs", "4", "--out-dir", str(tmp_path)]
    )
    low, high = report["rows"]
    assert low["sustainable"] and low["seats_enough"]
    assert not high["sustainable"]
    assert report["workload"]["rates_per_s"] == [10.0, 1e9]


@pytest.mark.parametrize(
    "argv",
    [
        ["--rates", "0"],
        ["--rates", "-5"],
        ["--input-len", "0"],
        ["--num-requests", "-1"],
        ["--tbps", "0"],
        ["--max-prefill-tokens-beside-decodes", "0"],
        ["--rates", "nan"],
        ["--rates", "inf"],
    ],
)
def test_refuses_a_number_that_is_not_above_zero(argv, capsys):
    with pytest.raises(SystemExit):
        floor.parse_args(argv)
    assert "must be above 0 and finite" in capsys.readouterr().err
