"""bench/issue_table.py: the table read back from each side's results (written here as the bench scripts write
them), the jobs' plans, and --table-only. The whole call runs on the device; its plumbing's CPU smoke test is
``python bench/issue_table.py --smoke --sides now``."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load_script

table = load_script("issue_table")


def _write(path: Path, doc: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "result.json").write_text(json.dumps(doc))


def _point(rate: float, **values) -> dict:
    point = {"rate_qps": rate, "requests_sent": 100, "requests_completed": 100, "server": {}}
    return {**point, **values}


def _side(root: Path, scale: float) -> None:
    """Results of one side: every figure ``scale`` times a base value."""
    decode = [{"batch": 1, "itl_p50_ms": 4.0 * scale}, {"batch": 64, "itl_p50_ms": 6.0 * scale}]
    _write(root / "engine" / "greedy", {"decode": decode})
    _write(root / "engine" / "sampled", {"decode": [{"batch": 1, "itl_p50_ms": 4.2 * scale}]})
    _write(
        root / "engine" / "moe",
        {"decode": [{"batch": 1, "itl_p50_ms": 4.5}, {"batch": 8, "itl_p50_ms": 9.0}]},
    )
    for name, tps in (("seed-e4b", 95_100), ("seed-e2b", 139_400), ("seed-moe", 30_500 / scale)):
        _write(root / "engine" / name, {"figures": {"total_tokens_per_s": tps}})
    _write(root / "engine" / "load-31b", {"load_s": 31.4})
    served = root / "served"
    _write(
        served / "video-1qps",
        {"points": [_point(1, ttft_p50_s=0.040 * scale, server={"prepare_mean_s": 0.016})]},
    )
    _write(
        served / "video-1qps-new",
        {"points": [_point(1, ttft_p50_s=0.050 * scale, server={"prepare_mean_s": 0.020})]},
    )
    sweep = [_point(r, e2e_p95_s=e) for r, e in ((32, 0.134), (48, 0.181 * scale), (64, 0.370))]
    _write(served / "video-sweep", {"points": sweep})
    saturation = [
        _point(32, output_tokens_per_s=3911, itl_p50_s=0.0061),
        _point(64, output_tokens_per_s=6083, itl_p50_s=0.0076),
    ]
    _write(served / "text-saturation", {"points": saturation})
    _write(served / "text-beside-video", {"points": [_point(0, itl_p50_s=0.0055, itl_p95_s=0.0157)]})
    (served / "ready.json").write_text(json.dumps({"ready_s": 41.2}))


def test_the_table_reads_both_sides(tmp_path):
    _side(tmp_path / "before", 1.0)
    _side(tmp_path / "now", 0.5)
    doc, markdown = table.build_table(tmp_path, {"device": "H100", "now": "abc", "before": "def"})
    rows = {r["row"]: r for r in doc["rows"]}
    assert rows["decode ITL, B=1, greedy (ms)"] == {
        "row": "decode ITL, B=1, greedy (ms)",
        "goal": "<= 3.4",
        "before": "4.0",
        "now": "2.0",
    }
    assert rows["decode ITL, B=64 (ms)"]["now"] == "3.0"
    sweep = rows["highest video QPS with p95 E2E <= 300 ms (10 output tokens)"]
    assert sweep["before"].startswith("48 QPS") and sweep["now"].startswith("48 QPS")
    assert (
        "6,083 tok/s at 64 QPS (ITL p50 7.6 ms)"
        in rows["served text 500 in / 128 out: output tok/s at saturation"]["now"]
    )
    assert rows["seed workloads, 30 prompts: e4b 7000/10, e2b 3000/100, 26b-a4b 3000/100 (total tok/s)"][
        "now"
    ] == ("95.1k, 139.4k, 61.0k")
    assert rows["31b bf16: load and warm-up (s)"]["before"] == "31.4"
    # what no run wrote stays empty, never a guess
    assert rows["audio TTFT p50 at 4 QPS; encoder mean (ms)"]["now"] == "–; –"
    assert "| decode ITL, B=1, greedy (ms) | 4.0 | 2.0 | <= 3.4 |" in markdown
    video = next(r for name, r in rows.items() if name.startswith("video (6 x 480p) TTFT p50 at 1 QPS"))
    assert video["now"] == "20.0; 16.0, new: 25.0; 20.0"


def test_a_rate_that_drops_requests_does_not_count(tmp_path):
    dropped = [_point(32, e2e_p95_s=0.1), {**_point(64, e2e_p95_s=0.2), "requests_completed": 50}]
    assert table._best_video_rate(dropped).startswith("32 QPS")
    assert table._best_video_rate([_point(32, e2e_p95_s=0.5)]).startswith("none")
    assert table._best_video_rate([]) == "–"


def test_the_plans_name_each_runs_output(tmp_path):
    plan = table.Plan()
    ordered = table.engine_runs(plan, tmp_path)
    runs = dict(ordered)
    assert set(runs) == {"greedy", "sampled", "moe", "seed-e4b", "seed-e2b", "seed-moe", "load-31b"}
    assert ordered[-1][0] == "load-31b"  # an old tree's slow 31B load must not take the seeds' time
    for name, argv in runs.items():
        assert str(tmp_path / name) in argv and argv[0].startswith("bench/")
    assert runs["seed-e4b"][runs["seed-e4b"].index("--input-len") + 1] == "7000"
    served, beside = table.served_runs(plan, "http://127.0.0.1:1")
    assert [name for name, _ in served][0] == "cold-burst"  # first, right after /health
    assert set(beside) == {"text-beside-video", "text-beside-audio"}
    assert "--rates" in beside["text-beside-video"][1] and "32" in beside["text-beside-video"][1]


def test_table_only_runs_nothing(tmp_path, capsys):
    _side(tmp_path / "now", 1.0)
    assert table.main(["--table-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "issue_table.md").read_text().count("\n| ") == len(table.ROWS) + 1
    assert json.loads((tmp_path / "issue_table.json").read_text())["rows"][0]["now"] == "4.0"


def test_jobs_picks_what_each_side_runs(tmp_path, monkeypatch):
    """``--jobs engine``: the engine's rows alone (one GPU, one call), the served job never started."""
    ran: list[tuple[str, str]] = []
    monkeypatch.setattr(table, "engine_job", lambda tree, out, *a: ran.append(("engine", out.parent.name)))
    monkeypatch.setattr(table, "served_job", lambda tree, out, *a: ran.append(("served", out.parent.name)))
    assert table.main(["--smoke", "--sides", "now", "--jobs", "engine", "--out", str(tmp_path)]) == 0
    assert ran == [("engine", "now")]
    ran.clear()
    assert table.main(["--smoke", "--sides", "now", "--out", str(tmp_path)]) == 0
    assert sorted(ran) == [("engine", "now"), ("served", "now")]
