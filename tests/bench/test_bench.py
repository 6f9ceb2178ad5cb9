"""``g4serve bench`` on the tiny model (CPU): sweeps, rate control, metrics, reports, compare, every
workload's requests, the offline and closed-loop modes, and stream parsing against a fake peer."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import wave
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from g4serve.bench import cli, common, loadgen, report  # noqa: E402 - after the importorskips
from g4serve.bench.workloads import WORKLOADS, make_workload  # noqa: E402

REQUIRED_POINT_FIELDS = (
    "requests_completed",
    "errors",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p95_s",
    "e2e_p50_s",
    "e2e_p95_s",
    "e2e_p99_s",
    "output_tokens_per_s",
    "requests_per_s",
    "mean_prompt_tokens",
    "mean_output_tokens",
)
REQUIRED_META_FIELDS = (
    "git_commit",
    "date",
    "device",
    "torch_version",
    "python_version",
    "model",
    "workload",
    "command",
    "label",
)


def _serve_args(model_dir: Path) -> list[str]:
    return [str(model_dir), "--device", "cpu", "--dtype", "float32", "--kv-cache-bytes", str(32 << 20)]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = common.InProcessServer([*_serve_args(tiny_model_dir), "--served-model-name", "tiny"])
    yield running
    running.stop()


def _check_point(point: dict, *, output_tokens: int | None = None) -> None:
    for name in REQUIRED_POINT_FIELDS:
        assert point.get(name) is not None, name
    assert point["errors"] == 0, point["first_errors"]
    assert point["requests_completed"] == point["requests_sent"] > 0
    for metric in ("ttft", "e2e"):
        assert 0 < point[f"{metric}_p50_s"] <= point[f"{metric}_p95_s"] <= point[f"{metric}_p99_s"]
    assert 0 < point["itl_p50_s"] <= point["itl_p95_s"] <= point["itl_p99_s"]
    assert point["ttft_p50_s"] <= point["e2e_p99_s"]
    assert point["output_tokens_per_s"] > 0 and point["requests_per_s"] > 0
    if output_tokens is not None:
        assert point["mean_output_tokens"] == output_tokens  # ignore_eos holds the length


# ---- end to end --------------------------------------------------------------------------------------------
def test_text_sweep_with_own_server_then_compare(tiny_model_dir, tmp_path):
    """Two rates against the server the bench starts itself; rate control, metrics, files, compare."""
    out = tmp_path / "a"
    rates, duration = (2.0, 4.0), 2.5
    rc = cli.main(
        [
            "bench",
            "--workload",
            "text",
            "--rates",
            ",".join(map(str, rates)),
            "--duration",
            str(duration),
            "--warmup",
            "2",
            "--out",
            str(out),
            "--label",
            "tiny-a",
            "--in-process-server",
            "--serve-args",
            " ".join(_serve_args(tiny_model_dir)),
        ]
    )
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    meta = result["meta"]
    for name in REQUIRED_META_FIELDS:
        assert meta.get(name), name
    assert meta["label"] == "tiny-a" and meta["workload"]["name"] == "text"
    assert meta["command"].startswith("g4serve bench --workload text")
    assert meta["target"].startswith("in-process")
    assert [p["rate_qps"] for p in result["points"]] == list(rates)
    for point in result["points"]:
        _check_point(point, output_tokens=10)
        # Constant arrivals: every send of the plan, at the requested rate (within 10%).
        assert point["requests_sent"] == math.ceil(point["rate_qps"] * duration)
        assert abs(point["achieved_send_rate_qps"] / point["rate_qps"] - 1) < 0.10
        assert point["send_lag_p50_s"] < 0.05  # on time (a loaded CI box may delay a few sends)
        assert point["client_cpu_share"] is None  # the server shares this process: not the client's alone
        assert 400 <= point["mean_prompt_tokens"] <= 600  # ~500 after calibration
        server = point["server"]  # the /metrics split: one observation per request of this point
        assert server["ttft_count"] == point["requests_completed"]
        assert server["queue_mean_s"] is not None and server["ttft_mean_s"] > 0
        assert server["prepare_count"] == point["requests_completed"] and server["prepare_mean_s"] > 0
        assert server["encoder_count"] == 0  # text only
        assert (
            server["prefix_cache_hit_tokens"]
            < 0.5 * point["mean_prompt_tokens"] * point["requests_completed"]
        )
    for name in ("results.md", "ttft_p95.png", "itl_p50.png", "e2e_p95.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| 2.0 |" in (out / "results.md").read_text()

    # compare: the same run and a copy that is twice as slow, labelled B.
    slow = json.loads(json.dumps(result))
    slow["meta"]["label"] = "tiny-b"
    for point in slow["points"]:
        point["ttft_p95_s"] *= 2
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps(slow))
    cmp_dir = tmp_path / "cmp"
    assert (
        cli.main(
            [
                "bench",
                "compare",
                str(out / "results.json"),
                str(tmp_path / "b" / "results.json"),
                "--out",
                str(cmp_dir),
            ]
        )
        == 0
    )
    table = (cmp_dir / "compare.md").read_text()
    assert "tiny-a" in table and "tiny-b" in table and "(2.00×)" in table
    for name in ("ttft_p95.png", "itl_p50.png", "e2e_p95.png"):
        assert (cmp_dir / name).stat().st_size > 0


def test_default_own_server_is_a_subprocess(tiny_model_dir, tmp_path):
    rc = cli.main(
        [
            "bench",
            "--workload",
            "text",
            "--prompt-tokens",
            "100",
            "--rates",
            "8",
            "--num-requests",
            "3",
            "--warmup",
            "0",
            "--no-calibrate",
            "--no-plots",
            "--out",
            str(tmp_path),
            "--serve-args",
            " ".join(_serve_args(tiny_model_dir)),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["target"].startswith("subprocess")
    assert result["meta"]["workload"]["calibration"]["measured"] is False
    _check_point(result["points"][0], output_tokens=10)
    assert result["points"][0]["server"]["ttft_count"] == 3
    assert 0 <= result["points"][0]["client_cpu_share"] < 4  # the server is another process: the client's own


def test_concurrency_mode_with_httpx(server, tmp_path):
    rc = cli.main(
        [
            "bench",
            "--workload",
            "qna",
            "--output-tokens",
            "12",
            "--concurrency",
            "1,3",
            "--num-requests",
            "6",
            "--warmup",
            "1",
            "--base-url",
            server.base_url + "/v1",
            "--http-client",
            "httpx",
            "--out",
            str(tmp_path),
            "--no-plots",
            "--save-requests",
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["model"] == "tiny" and result["meta"]["load"]["http_client"] == "httpx"
    assert [p["concurrency"] for p in result["points"]] == [1, 3]
    for point in result["points"]:
        _check_point(point, output_tokens=12)
        assert point["requests_sent"] == 6
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 12
    assert not (tmp_path / "ttft_p95.png").exists()


def test_offline_mode(tiny_model_dir, tmp_path):
    rc = cli.main(
        [
            "bench",
            "--workload",
            "extraction",
            "--prompt-tokens",
            "512",
            "--output-tokens",
            "8",
            "--offline",
            "--concurrency",
            "1,2",
            "--num-requests",
            "4",
            "--warmup",
            "1",
            "--serve-args",
            " ".join(_serve_args(tiny_model_dir)),
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["target"].startswith("offline") and result["meta"]["label"] == "g4serve-offline"
    for point in result["points"]:
        _check_point(point, output_tokens=8)
        assert point["requests_sent"] == 4
        assert 400 <= point["mean_prompt_tokens"] <= 650
        assert point["server"]["queue_mean_s"] is not None
    assert (tmp_path / "itl_p50.png").exists()


def test_extraction_grid(server, tmp_path):
    """`bench grid`: 2 prompt sizes x 2 output lengths x schema off/on, 2 requests per cell, files and
    order."""
    pytest.importorskip("g4serve.structured")
    pytest.importorskip("xgrammar")
    rc = cli.main(
        [
            "bench",
            "grid",
            "--prompt-tokens",
            "320,400",
            "--output-tokens",
            "4,160",
            "--requests-per-cell",
            "2",
            "--concurrency",
            "2",
            "--warmup",
            "1",
            "--base-url",
            server.base_url,
            "--label",
            "tiny-grid",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "grid.json").read_text())
    meta, cells = result["meta"], result["cells"]
    for name in REQUIRED_META_FIELDS:
        assert meta.get(name), name
    assert meta["grid"]["requests_per_cell"] == 2 and meta["workload"]["calibration"]["measured"]
    assert [(c["prompt_tokens_target"], c["max_tokens"], c["schema"]) for c in cells] == [
        (p, o, s) for p in (320, 400) for o in (4, 160) for s in (False, True)
    ]
    for cell in cells:
        for name in REQUIRED_POINT_FIELDS:
            assert cell.get(name) is not None, (name, cell)
        assert cell["errors"] == 0 and cell["requests_completed"] == cell["requests_sent"] == 2
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p95_s"] and 0 < cell["e2e_p50_s"] <= cell["e2e_p95_s"]
        assert abs(cell["mean_prompt_tokens"] / cell["prompt_tokens_target"] - 1) < 0.15
        if not cell["schema"]:
            assert cell["schema_valid_fraction"] is None and cell["mean_output_tokens"] == cell["max_tokens"]
        elif cell["max_tokens"] == 4:
            assert cell["schema_valid_fraction"] == 0.0  # cut before the object closed
        else:
            assert cell["schema_valid_fraction"] == 1.0 and cell["mean_output_tokens"] < 160
    small = [c for c in cells if c["max_tokens"] == 4 and not c["schema"]]
    assert (
        small[0]["e2e_p50_s"]
        < [c for c in cells if c["max_tokens"] == 160 and not c["schema"]][0]["e2e_p50_s"]
    )
    table = (tmp_path / "grid.md").read_text()
    assert "| 400 | 160 | on | 2/2 | 0 |" in table and "100%" in table
    for name in ("e2e_p95.png", "ttft_p95.png"):
        assert (tmp_path / name).stat().st_size > 0


# ---- workloads ---------------------------------------------------------------------------------------------
def _post(server, body: dict) -> dict:
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _parts(request, kind: str) -> list[dict]:
    return [
        p
        for m in request.messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == kind
    ]


def test_every_workload_builds_valid_requests(server):
    from PIL import Image

    for name in WORKLOADS:
        workload = make_workload(name, seed=3, image_size="320x240", output_tokens=3)
        workload.assume_calibration()
        request = workload.request("test", 0)
        assert request == workload.request("test", 0)  # a pure function of (seed, namespace, index)
        assert request != workload.request("test", 1)
        body = request.body("tiny", ignore_eos=True)
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
        assert body["skip_special_tokens"] is False  # tokens past the natural end still stream as chunks
        assert not {"ignore_eos", "skip_special_tokens"} & set(request.body("tiny", ignore_eos=False))
        reply = _post(server, {**request.body("tiny", stream=False), "max_tokens": 2})
        assert reply["usage"]["completion_tokens"] == 2, name
        if name == "video":
            (part,) = _parts(request, "video")
            assert len(part["video"]) == 6
            for url in part["video"]:
                assert url.startswith("data:image/jpeg;base64,")
                with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as im:
                    assert (im.format, im.size) == ("JPEG", (854, 480))
        if name == "image":
            (part,) = _parts(request, "image_url")
            with Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))) as im:
                assert im.size == (320, 240)
        if name == "audio":
            (part,) = _parts(request, "input_audio")
            assert part["input_audio"]["format"] == "wav"
            with wave.open(io.BytesIO(base64.b64decode(part["input_audio"]["data"]))) as f:
                assert 3.0 <= f.getnframes() / f.getframerate() <= 10.0
    qna = make_workload("qna")
    lengths = {qna.request("t", i).max_tokens for i in range(20)}
    assert len(lengths) > 5 and all(128 <= n <= 512 for n in lengths)
    assert "send" in " ".join(make_workload("extraction").request("t", i).info["command"] for i in range(30))


def test_the_video_workload_sends_container_videos_too(server):
    """``--video-format mp4``: the same frames as one H.264 MP4 (a ``video_url`` data URL), which the
    server decodes as a container: every frame there, answered."""
    from g4serve.processing.video import load_video

    workload = make_workload("video", seed=3, frame_size="160x96", output_tokens=3, video_format="mp4")
    workload.assume_calibration()
    request = workload.request("test", 0)
    (part,) = _parts(request, "video_url")
    url = part["video_url"]["url"]
    assert url.startswith("data:video/mp4;base64,")
    video = load_video(base64.b64decode(url.split(",", 1)[1]))
    assert video.frames.shape == (6, 96, 160, 3) and video.fps == 30.0
    assert workload.params()["video_format"] == "mp4" and request.info["video_format"] == "mp4"
    reply = _post(server, {**request.body("tiny", stream=False), "max_tokens": 2})
    assert reply["usage"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="^--video-format: expected jpeg or mp4"):
        make_workload("video", video_format="webm")


def test_extraction_schema_output_validates(server):
    pytest.importorskip("g4serve.structured")
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from g4serve.bench.workloads import EXTRACTION_SCHEMA, request_bytes

    workload = make_workload("extraction", schema=True, prompt_tokens=300, output_tokens=160)
    workload.assume_calibration(tokens_per_word=4.0)

    async def run() -> list[loadgen.RequestResult]:
        client = loadgen.make_http_client("auto")
        try:
            url = server.base_url + "/v1/chat/completions"
            bodies = [
                request_bytes(workload.request("schema", i), "tiny", ignore_eos=True, temperature=0.0)
                for i in range(3)
            ]
            return await asyncio.gather(
                *(loadgen.stream_chat(client, url, b, i, 0.0, None) for i, b in enumerate(bodies))
            )
        finally:
            await client.aclose()

    for result in asyncio.run(run()):
        assert result.ok, result.error
        jsonschema.validate(json.loads(result.text), EXTRACTION_SCHEMA)
        assert result.output_tokens < 160  # the grammar ended it, ignore_eos or not


# ---- units -------------------------------------------------------------------------------------------------
def test_parser_registers_bench_and_compare():
    parser = argparse.ArgumentParser(prog="g4serve")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_bench_arguments(sub)
    args = parser.parse_args(
        [
            "bench",
            "--workload",
            "video",
            "--rates",
            "1,2.5",
            "--arrival",
            "poisson",
            "--duration",
            "5",
            "--out",
            "d",
            "--base-url",
            "http://x:1",
            "--model",
            "m",
            "--api-key",
            "k",
            "--label",
            "L",
            "--audio-seconds",
            "2,4",
        ]
    )
    assert args.func is cli.run_bench_command and args.command == "bench"
    assert args.rates == [1.0, 2.5] and args.arrival == "poisson" and args.audio_seconds == (2.0, 4.0)
    assert parser.parse_args(["bench", "--extra-body", '{"a": [1]}']).extra_body == {"a": [1]}
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--extra-body", "[1]"])
    args = parser.parse_args(
        ["bench", "grid", "--prompt-tokens", "128,512", "--output-tokens", "16", "--out", "d"]
    )
    assert (
        args.func.__name__ == "run_grid_command"
        and args.prompt_tokens == [128, 512]
        and args.schema == "both"
    )
    args = parser.parse_args(["bench", "compare", "a.json", "b.json", "--out", "d", "--labels", "x,y"])
    assert args.func is cli.compare_command and args.files == ["a.json", "b.json"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--rates", "0,1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--concurrency", "1.5"])
    bad = parser.parse_args(
        ["bench", "--workload", "text", "--rates", "1", "--concurrency", "2", "--out", "d"]
    )
    with pytest.raises(ValueError, match="not both"):
        cli.run_bench_command(bad)
    assert cli.main(["bench", "--rates", "1"]) == 2  # --workload missing: a message, not a traceback


def test_arrival_plans_are_seeded_and_hold_the_rate():
    constant = loadgen.planned_offsets(4.0, "constant", "s", duration_s=2.0, num_requests=None)
    assert constant == [i / 4 for i in range(8)]
    assert loadgen.planned_offsets(4.0, "constant", "s", duration_s=None, num_requests=3) == [0, 0.25, 0.5]
    poisson = loadgen.planned_offsets(50.0, "poisson", "seed", duration_s=100.0, num_requests=None)
    assert poisson == loadgen.planned_offsets(50.0, "poisson", "seed", duration_s=100.0, num_requests=None)
    assert abs(len(poisson) / 100.0 / 50.0 - 1) < 0.05


def test_itl_divides_multi_token_chunks_fairly():
    # 5 tokens in 3 content chunks: 4 tokens after the first chunk over 2 gaps, 2 tokens each.
    result = loadgen.RequestResult(
        0, None, 0.0, ttft_s=0.1, e2e_s=0.5, chunk_times_s=[0.1, 0.3, 0.5], output_tokens=5
    )
    values, weights = report.itl_samples(result)
    assert values == pytest.approx([0.1, 0.1]) and weights == [2.0, 2.0]
    assert report.tpot(result) == pytest.approx(0.1)
    one_per_chunk = loadgen.RequestResult(
        0, None, 0.0, ttft_s=0.1, e2e_s=0.3, chunk_times_s=[0.1, 0.2, 0.3], output_tokens=3
    )
    assert report.itl_samples(one_per_chunk) == ([pytest.approx(0.1)] * 2, [1.0, 1.0])
    assert report.weighted_percentile([1, 2, 3, 4], [1, 1, 1, 1], 50) == 2
    assert report.weighted_percentile([1, 10], [9, 1], 95) == 10
    assert report.weighted_percentile([1, 10], [9, 1], 50) == 1


def test_prometheus_split():
    before = loadgen.parse_prometheus(
        '# HELP x\ng4serve_request_queue_time_seconds_sum{model_name="m"} 1.0\n'
        'g4serve_request_queue_time_seconds_count{model_name="m"} 2.0\n'
        'g4serve_time_to_first_token_seconds_sum{model_name="m"} 2.0\n'
        'g4serve_time_to_first_token_seconds_count{model_name="m"} 2.0\n'
        'g4serve_prompt_tokens_total{model_name="m"} 100.0\nplain_gauge 3\n'
    )
    after = dict(before)
    after.update(
        {
            "g4serve_request_queue_time_seconds_sum": 2.0,
            "g4serve_request_queue_time_seconds_count": 4.0,
            "g4serve_time_to_first_token_seconds_sum": 5.0,
            "g4serve_time_to_first_token_seconds_count": 4.0,
            "g4serve_prompt_tokens_total": 300.0,
        }
    )
    split = loadgen.server_stage_split(before, after)
    assert split["queue_mean_s"] == pytest.approx(0.5) and split["ttft_mean_s"] == pytest.approx(1.5)
    assert split["encoder_mean_s"] is None and split["prompt_tokens"] == 200
    assert before["plain_gauge"] == 3
    assert loadgen.server_stage_split(None, after) is None
    assert "engine_thread_ms_per_step" not in split  # a server without the engine thread's phases


def test_engine_thread_split_per_step():
    text = 'g4serve_num_steps 10\ng4serve_engine_thread_seconds_total{phase="wait"} 1.0\n'
    text += 'g4serve_engine_thread_seconds_total{phase="launch"} 0.5\n'
    before = loadgen.parse_prometheus(text)
    assert before['g4serve_engine_thread_seconds_total{phase="wait"}'] == 1.0
    assert before["g4serve_engine_thread_seconds_total"] == 1.5  # summed over the label sets too
    after = loadgen.parse_prometheus(
        text.replace("10", "110").replace("} 1.0", "} 1.4").replace("} 0.5", "} 0.6")
    )
    split = loadgen.engine_thread_split(before, after)
    assert split["engine_steps"] == 100
    assert split["engine_thread_ms_per_step"] == pytest.approx({"wait": 4.0, "launch": 1.0})
    assert "engine_thread_cpu_ms_per_step" not in split  # a server without the CPU split
    cpu = 'g4serve_engine_thread_cpu_seconds_total{phase="launch"} '
    split = loadgen.engine_thread_split(
        loadgen.parse_prometheus(text + cpu + "0.2\n"), {**after, **loadgen.parse_prometheus(cpu + "0.5\n")}
    )
    assert split["engine_thread_cpu_ms_per_step"] == pytest.approx({"launch": 3.0})


def _histogram(name: str, counts: dict[str, int]) -> str:
    """A Prometheus text histogram (cumulative bucket counts by ``le``) as prometheus_client writes it."""
    lines = [f'{name}_bucket{{model_name="m",le="{le}"}} {n}' for le, n in counts.items()]
    return "\n".join(lines + [f"{name}_count {counts['+Inf']}"]) + "\n"


def test_histogram_quantile_between_two_scrapes():
    """Only what was observed between the scrapes counts, interpolated in its bucket as Prometheus does."""
    name = "g4serve_inter_token_latency_seconds"
    before = loadgen.parse_prometheus(_histogram(name, {"0.005": 100, "0.01": 100, "0.02": 100, "+Inf": 100}))
    after = loadgen.parse_prometheus(_histogram(name, {"0.005": 190, "0.01": 196, "0.02": 200, "+Inf": 200}))
    # Between them: 90 gaps <= 5 ms, 6 in (5, 10], 4 in (10, 20].
    assert loadgen.histogram_quantile(before, after, name, 0.5) == pytest.approx(0.005 * 50 / 90)
    assert loadgen.histogram_quantile(before, after, name, 0.95) == pytest.approx(0.005 + 0.005 * 5 / 6)
    assert loadgen.histogram_quantile(before, after, name, 0.99) == pytest.approx(0.01 + 0.01 * 3 / 4)
    assert loadgen.histogram_quantile(before, before, name, 0.5) is None  # nothing observed
    assert loadgen.histogram_quantile(before, after, "absent", 0.5) is None
    past = loadgen.parse_prometheus(_histogram(name, {"0.005": 100, "0.01": 100, "0.02": 100, "+Inf": 110}))
    assert loadgen.histogram_quantile(before, past, name, 0.5) == 0.02  # past the top bound: the bound
    split = loadgen.server_stage_split(before, after)
    assert split["server_itl_p95_s"] == pytest.approx(0.005 + 0.005 * 5 / 6)
    assert "event_loop_lag_p50_s" not in split and "step_intervals" not in split


def test_step_intervals_by_kind_between_two_scrapes():
    """Each kind's quantiles come from its own label set only."""
    name = "g4serve_engine_step_interval_seconds"

    def text(decode: tuple[int, int], encode: tuple[int, int]) -> str:
        lines = []
        for kind, (fast, total) in (("decode", decode), ("encode", encode)):
            lines += [f'{name}_bucket{{kind="{kind}",le="0.005"}} {fast}']
            lines += [f'{name}_bucket{{kind="{kind}",le="0.01"}} {total}']
            lines += [
                f'{name}_bucket{{kind="{kind}",le="+Inf"}} {total}',
                f'{name}_count{{kind="{kind}"}} {total}',
            ]
        return "\n".join(lines) + "\n"

    before = loadgen.parse_prometheus(text((10, 10), (0, 0)))
    after = loadgen.parse_prometheus(text((110, 110), (0, 20)))  # 100 fast decode steps, 20 slow encode steps
    split = loadgen.step_interval_split(before, after)
    assert split["decode"]["steps"] == 100 and split["decode"]["p95_s"] == pytest.approx(0.005 * 0.95)
    assert split["encode"]["steps"] == 20 and split["encode"]["p50_s"] == pytest.approx(0.0075)
    assert "prefill" not in split  # not served


def test_fake_peer_without_metrics_or_usage():
    """A peer with no /metrics, multi-token chunks and no usage: parsed, timed, metrics skipped."""
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hello"}}]},
        {"choices": [{"delta": {"content": " world"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
    ]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404, text="not found")
        if request.url.path == "/v1/chat/completions":
            assert json.loads(request.content)["max_tokens"] == 4
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(400, json={"error": {"message": "bad"}})

    async def run():
        client = loadgen.make_http_client("httpx")
        await client._client.aclose()
        client._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            metrics = await loadgen.scrape_metrics(client, "http://peer")
            ok = await loadgen.stream_chat(
                client, "http://peer/v1/chat/completions", b'{"max_tokens": 4}', 0, 0.0, None
            )
            bad = await loadgen.stream_chat(client, "http://peer/v1/other", b"{}", 1, 0.0, None)
            return metrics, ok, bad
        finally:
            await client.aclose()

    metrics, ok, bad = asyncio.run(run())
    assert metrics is None
    assert ok.ok and ok.text == "Hello world" and len(ok.chunk_times_s) == 2 and ok.output_tokens == 2
    assert not bad.ok and "HTTP 400" in bad.error


def test_stream_without_done_ends_at_finish_reason():
    """transformers serve sends no [DONE]: a stream whose last chunk carries finish_reason is complete; one
    that just stops is not. --extra-body fields reach every request body."""
    from g4serve.bench.workloads import request_bytes

    finished = [
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}], "usage": {"completion_tokens": 1}},
    ]
    streams = {"/done-less": finished, "/cut": finished[:1]}
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in streams[request.url.path])
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def run():
        client = loadgen.make_http_client("httpx")
        await client._client.aclose()
        client._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        body = request_bytes(
            make_workload("text").request("t", 0),
            "m",
            ignore_eos=False,
            temperature=0.0,
            extra_body={"generation_config": '{"min_new_tokens": 9}', "max_tokens": 3},
        )
        try:
            return [
                await loadgen.stream_chat(client, f"http://peer{path}", body, 0, 0.0, None)
                for path in streams
            ]
        finally:
            await client.aclose()

    done_less, cut = asyncio.run(run())
    assert done_less.ok and done_less.output_tokens == 1 and done_less.text == "a"
    assert not cut.ok and "without [DONE]" in cut.error
    assert bodies[0]["generation_config"] == '{"min_new_tokens": 9}' and bodies[0]["max_tokens"] == 3
    assert "ignore_eos" not in bodies[0]


def test_drain_deadline_counts_slow_requests_as_errors():
    """Sending stops on time and the wait for in-flight requests is bounded, open and closed loop."""
    from concurrent.futures import ThreadPoolExecutor

    class SlowStream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
            await asyncio.sleep(5)
            yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=SlowStream(), headers={"content-type": "text/event-stream"})

    async def run():
        client = loadgen.make_http_client("httpx")
        await client._client.aclose()
        client._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        pool = ThreadPoolExecutor(1)
        try:
            rate = await loadgen.run_rate_point(
                client,
                "http://peer/v1/chat/completions",
                lambda i: b"{}",
                pool,
                rate_qps=10,
                duration_s=0.3,
                drain_timeout_s=0.2,
            )
            closed = await loadgen.run_concurrency_point(
                client,
                "http://peer/v1/chat/completions",
                lambda i: b"{}",
                pool,
                concurrency=2,
                duration_s=0.2,
                drain_timeout_s=0.2,
            )
            return rate, closed
        finally:
            pool.shutdown()
            await client.aclose()

    rate, closed = asyncio.run(run())
    assert len(rate.results) == 3 and rate.timed_out == 3 and rate.wall_s < 1.5
    assert all("drain deadline" in r.error for r in rate.results)
    assert len(closed.results) == 2 and closed.timed_out == 2 and closed.wall_s < 1.5
    point = report.summarize_point(closed, {"mode": "concurrency", "concurrency": 2})
    assert point["errors"] == 2 and point["requests_completed"] == 0 and point["ttft_p50_s"] is None
    # the client's own CPU over the point (this process: nothing but the client here)
    assert 0 <= rate.client_cpu_s and 0 <= point["client_cpu_share"] < 4


def test_a_client_near_a_whole_core_is_warned_about(capsys):
    from g4serve.bench import cli as bench_cli

    point = {"mode": "rate", "rate_qps": 96.0, "requests_completed": 1, "requests_sent": 1, "errors": 0}
    point |= {"ttft_p50_s": 0.01, "itl_p50_s": 0.0, "output_tokens_per_s": 9000.0}
    bench_cli._progress({**point, "client_cpu_share": 0.5})
    assert "warning" not in capsys.readouterr().err
    bench_cli._progress({**point, "client_cpu_share": 0.95})
    assert "the client itself used 95% of a core" in capsys.readouterr().err


def test_time_sweep_keeps_the_fastest_and_skips_what_the_compiler_rejects(capsys):
    from g4serve.bench.timing import time_sweep

    def time_config(cfg):
        if cfg["tile"] == 64:
            raise RuntimeError("out of resources")
        return {16: 2.0, 32: 1.5, 128: 3.0}[cfg["tile"]]

    sweep = time_sweep([{"tile": t} for t in (16, 32, 64, 128)], time_config)
    assert sweep["best"] == {"tile": 32} and sweep["best_ms"] == 1.5
    assert [t["config"]["tile"] for t in sweep["trials"]] == [16, 32, 128]
    assert "{'tile': 64}: RuntimeError" in capsys.readouterr().out
