"""bench/capacity.py: the capacity model's arithmetic on made-up figures, and that its inputs file says where
every figure comes from."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("capacity", ROOT / "bench" / "capacity.py")
capacity = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("capacity", capacity)  # its dataclasses look their module up while it loads
_spec.loader.exec_module(capacity)

FLAT = capacity.Model("flat", {1: 4.0, 8: 4.0, 32: 8.0}, {1000: 10.0})


def test_tokens_per_second():
    assert capacity.decode_tokens_per_s(64, 6.4) == pytest.approx(10_000)
    assert capacity.decode_tokens_per_s(1, 4.0) == pytest.approx(250)
    assert capacity.prefill_tokens_per_s(2048, 20.48) == pytest.approx(100_000)


def test_largest_batch_within_never_goes_past_the_measured_batches():
    itl = {1: 4.0, 8: 5.0, 32: 6.0, 64: 7.0}
    assert capacity.largest_batch_within(itl, 6.0) == 32
    assert capacity.largest_batch_within(itl, 1000.0) == 64  # not 1000 / 7 x 64
    assert capacity.largest_batch_within(itl, 3.9) is None
    assert capacity.largest_batch_within(itl, 60.0, scale=10.0) == 32  # 6.0 x 10 <= 60 < 7.0 x 10
    # A slower smaller batch (measured so for e4b fp8 at 32 against 64) does not hide a larger one that fits.
    assert capacity.largest_batch_within({8: 4.0, 32: 6.8, 64: 6.5}, 6.6) == 64


def test_replicas_round_up_and_add_spares():
    assert capacity.replicas_for(100, 10) == 10
    assert capacity.replicas_for(101, 10) == 11
    assert capacity.replicas_for(100, 10, spare=1) == 11
    assert capacity.replicas_for(0.1, 10) == 1
    assert capacity.replicas_for(3 * 0.7 * 10, 0.7 * 10) == 3  # no float residue turns 3 into 4
    with pytest.raises(ValueError):
        capacity.replicas_for(1, 0)


def test_voice_capacity_scales_the_measured_call_by_step_time():
    # Measured alone on FLAT: p50 20 ms, p95 30 ms, i.e. 5 and 7.5 steps of 4 ms.
    cap = capacity.voice_capacity(FLAT, FLAT, 20.0, 30.0, 40.0, 0.5, 10.0, 1.0)
    # Batch 8 keeps the 4 ms step (p95 30 ms); batch 32 doubles it (60 ms > 40): 8 calls in flight.
    assert cap.batch == 8
    assert (cap.extraction_p50_ms, cap.extraction_p95_ms) == pytest.approx((20.0, 30.0))
    assert cap.llm_calls_per_s == pytest.approx(8 / 0.020)  # Little's law: 400 calls/s
    # Half the utterances reach the model: 800 utterances/s, one per call every 10 s.
    assert cap.concurrent_calls == pytest.approx(8000)
    assert capacity.voice_capacity(FLAT, FLAT, 20.0, 30.0, 40.0, 0.5, 10.0, 0.5).concurrent_calls == 4000
    # The SLO loosened: batch 32 at twice the step time.
    wide = capacity.voice_capacity(FLAT, FLAT, 20.0, 30.0, 60.0, 0.5, 10.0, 1.0)
    assert wide.batch == 32 and wide.extraction_p95_ms == pytest.approx(60.0)
    assert wide.llm_calls_per_s == pytest.approx(32 / 0.040)


def test_voice_capacity_on_a_slower_model_and_a_missed_slo():
    slow = capacity.Model("slow", {1: 12.0, 8: 16.0}, {1000: 50.0})
    cap = capacity.voice_capacity(slow, FLAT, 20.0, 30.0, 100.0, 1.0, 10.0, 1.0)
    assert cap.batch == 1 and cap.extraction_p95_ms == pytest.approx(90.0)  # 3x the reference's step
    missed = capacity.voice_capacity(slow, FLAT, 20.0, 30.0, 60.0, 1.0, 10.0, 1.0)
    assert missed.batch is None and missed.concurrent_calls == 0
    assert missed.extraction_p95_ms == pytest.approx(90.0)  # what batch 1 would take


def test_audio_thread_capacity():
    # 250 ms of audio work per utterance: 4 utterances/s, one per call every 5 s, at 50%: 10 calls.
    assert capacity.calls_per_audio_thread(250.0, 5.0, 0.5) == pytest.approx(10.0)


def test_every_input_figure_says_where_it_comes_from():
    inputs = json.loads(capacity.INPUTS.read_text())
    for name, model in inputs["models"].items():
        assert model["kind"] == "measured" and model["source"], name
        assert 1 in {int(b) for b in model["decode_itl_ms"]}, f"{name}: batch 1 is the scaling reference"
        for key in model:
            if key.startswith("kv_") and not key.endswith("_source"):
                assert model["kv_source"], name
    sections = [inputs["voice_call"], inputs["streaming"], inputs["planning"]]
    figures = [v for section in sections for v in section.values() if isinstance(v, dict)]
    assert figures
    for figure in figures:
        assert figure["kind"] in ("measured", "assumption") and figure["source"], figure
    assert inputs["voice_call"]["reference_model"] in inputs["models"]


def test_report_prints_every_model(capsys):
    assert capacity.main(["--target-calls", "1000", "--turn-interval-s", "5"]) == 0
    out = capsys.readouterr().out
    for name in json.loads(capacity.INPUTS.read_text())["models"]:
        assert out.count(f"| {name} |") == 2, name
    assert "1,000 concurrent, one utterance every 5 s" in out
