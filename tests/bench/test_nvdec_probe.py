"""bench/nvdec_probe.py on the CPU: the clip it makes decodes on the host path into the frames g4serve
samples, and its report says what ran (no NVDEC section without a GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from bench_scripts import load_script

from g4serve.processing.video import load_video


def test_the_probes_clip_is_h264_and_every_frame_differs():
    import io

    import av

    probe = load_script("nvdec_probe")
    clip = probe.make_clip(seconds=0.5, fps=10, width=96, height=64)
    with av.open(io.BytesIO(clip)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
    frames = np.asarray(load_video(clip, num_frames=5).frames)
    assert frames.shape == (5, 64, 96, 3)
    assert all(np.abs(frames[i].astype(int) - frames[i + 1]).mean() > 1 for i in range(4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report: no NVDEC section")
def test_the_probe_reports_the_host_path_on_the_cpu(tmp_path, capsys):
    probe = load_script("nvdec_probe")
    rc = probe.main(["--seconds", "0.5", "--fps", "10", "--size", "96x64", "--num-frames", "4", "--reps", "1",
                     "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    (path,) = tmp_path.glob("nvdec_probe-*.json")
    report = json.loads(path.read_text())
    assert report["benchmark"] == "nvdec_probe" and report["clip"]["size"] == "96x64"
    assert report["host_frames_shape"] == [4, 64, 96, 3] and report["host_load_video"]["median_ms"] > 0
    assert "nvdec" not in report and "host_load_video" in capsys.readouterr().out


def test_concurrency_counts_every_video_and_the_processes_cpu():
    """``concurrency``: threads x per_thread timed decodes (after a warm round), videos a second and the
    process's CPU seconds a video."""
    import threading

    probe = load_script("nvdec_probe")
    calls: list[int] = []
    lock = threading.Lock()

    def decode():
        with lock:
            calls.append(1)
        sum(i * i for i in range(20_000))  # some CPU

    out = probe.concurrency(decode, threads=2, per_thread=3)
    assert out["videos"] == 6 and len(calls) == 1 + 2 + 6  # the warm-up call, the warm round, the timed ones
    assert out["videos_per_s"] > 0 and out["cpu_s_per_video"] > 0
