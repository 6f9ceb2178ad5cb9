"""Can a served video container be decoded on the GPU (NVDEC), and what does it save? Issue 23's "video
decoding with NVDEC where the container allows": first run before any of it was built, now also measuring
g4serve's own path (``--video-decoder nvdec``, ``processing/nvdec.py``).

On the machine it runs on it reports (a line each, and JSON under ``--out``):

- whether the driver's NVDEC library (``libnvcuvid.so.1``) loads, and whether PyNvVideoCodec (NVIDIA's
  Video Codec SDK bindings, a PyPI wheel: ``bench/device/nvdec_probe.sh`` carries it) imports;
- a clip made here with PyAV: ``--seconds`` of ``--size`` H.264 (yuv420p) at ``--fps`` in MP4, from moving
  synthetic frames;
- the host path: g4serve's ``load_video`` on the clip's bytes (PyAV decodes up to the last sampled frame),
  median and minimum ms;
- NVIDIA's own pipeline: ``PyNvVideoCodec.SimpleDecoder`` on the same bytes (its FFmpeg demuxes), RGB on the
  device (its BT.709 conversion), the frames g4serve samples, with and without creating the decoder;
- g4serve's path: PyAV demuxes under g4serve's limits, NVDEC decodes, the sampled frames converted as the
  host converts them (``NvdecVideos.load``), its first call (the decoder made) and later ones;
- how close each is to the host's frames (mean and maximum absolute difference);
- ``--threads`` threads decoding at once, the host path against g4serve's NVDEC path: videos a second and
  the process's CPU seconds a video.

Every stage that fails is reported with its error and the rest still runs, so one call answers what is
there. On a machine without a GPU only the clip and the host path run:

    python bench/nvdec_probe.py --out bench/results/nvdec-probe
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from g4serve.bench.meta import result_header, write_result_json
from g4serve.bench.workloads import encode_mp4
from g4serve.processing.limits import MediaLimits
from g4serve.processing.video import DEFAULT_NUM_FRAMES, load_video, sample_frame_indices


def make_clip(seconds: float, fps: int, width: int, height: int) -> bytes:
    """An H.264 MP4 of moving gradients and a moving square (every frame differs from its neighbours)."""
    ys, xs = np.mgrid[0:height, 0:width]

    def frames():
        for i in range(int(seconds * fps)):
            rgb = np.stack([(xs + 3 * i) % 256, (ys + 2 * i) % 256, (xs + ys + i) % 256], -1).astype(np.uint8)
            x0 = (7 * i) % max(1, width - 64)
            rgb[40:104, x0 : x0 + 64] = 255
            yield rgb

    return encode_mp4(frames(), fps)


def timed(fn: Callable[[], object], reps: int) -> tuple[dict[str, float], object]:
    """Median and minimum ms of ``reps`` calls after one warm-up, and the last call's result."""
    result = fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(times), "min_ms": min(times)}, result


def nvcuvid() -> dict[str, object]:
    try:
        ctypes.CDLL("libnvcuvid.so.1")
        return {"loads": True}
    except OSError as exc:
        return {"loads": False, "error": str(exc)}


def nvdec_frames(nvc, clip: bytes, num_frames: int, decoder=None):
    """The sampled frames, one uint8 [F, H, W, 3] tensor on the GPU, and the decoder (a new one if None)."""
    if decoder is None:
        decoder = nvc.SimpleDecoder(clip, gpu_id=0, output_color_type=nvc.OutputColorType.RGB)
    indices = sample_frame_indices(len(decoder), num_frames)
    frames = decoder.get_batch_frames_by_index(indices)
    return torch.stack([torch.as_tensor(f, device="cuda") for f in frames]), indices, decoder


def probe_nvdec(clip: bytes, host_frames: np.ndarray, num_frames: int, reps: int) -> dict[str, object]:
    out: dict[str, object] = {}
    try:
        import PyNvVideoCodec as nvc  # noqa: N813 - the package's own name
    except Exception as exc:  # noqa: BLE001 - not installed, or its libraries do not load: reported
        return {"imports": False, "error": f"{type(exc).__name__}: {exc}"}
    out["imports"], out["version"] = True, getattr(nvc, "__version__", None)
    try:
        out["with_decoder_creation"], (_, _, decoder) = timed(
            lambda: nvdec_frames(nvc, clip, num_frames), reps
        )
        out["decoder_reused"], (frames, indices, _) = timed(
            lambda: nvdec_frames(nvc, clip, num_frames, decoder), reps
        )
    except Exception as exc:  # noqa: BLE001 - the decode itself failed: reported with what came before
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["frames"], out["shape"] = len(indices), list(frames.shape)
    if tuple(frames.shape) == host_frames.shape:
        diff = (frames.cpu().int() - torch.from_numpy(host_frames).int()).abs()
        out["abs_diff_mean"], out["abs_diff_max"] = diff.float().mean().item(), int(diff.max())
    else:
        out["abs_diff_mean"] = None  # shapes differ: reported as they are
    return out


def g4serve_nvdec(clip: bytes, num_frames: int):
    """g4serve's path (``processing.nvdec``): the sampled frames on the GPU, on a side stream as the
    processor's threads run it, finished."""
    nvdec = _nvdec()
    with torch.cuda.stream(_side_stream()):
        frames = nvdec.load(clip, MediaLimits(), num_frames)
        torch.cuda.current_stream().synchronize()
    return frames


_state = threading.local()


def _nvdec():
    from g4serve.processing.nvdec import NvdecVideos

    if not hasattr(_state, "nvdec"):
        _state.nvdec = NvdecVideos("cuda")
    return _state.nvdec


def _side_stream() -> torch.cuda.Stream:
    if not hasattr(_state, "stream"):
        _state.stream = torch.cuda.Stream()
    return _state.stream


def probe_g4serve(clip: bytes, host_frames: np.ndarray, num_frames: int, reps: int) -> dict[str, object]:
    out: dict[str, object] = {}
    try:
        t0 = time.perf_counter()
        g4serve_nvdec(clip, num_frames)  # this thread's decoder made
        out["first_call_ms"] = 1e3 * (time.perf_counter() - t0)
        out["decoder_reused"], video = timed(lambda: g4serve_nvdec(clip, num_frames), reps)
    except Exception as exc:  # noqa: BLE001 - reported
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    if video is None:
        out["error"] = "the clip went to the host path"
        return out
    frames = video.frames.cpu()
    out["shape"] = list(frames.shape)
    diff = (frames.int() - torch.from_numpy(host_frames).int()).abs()
    out["abs_diff_mean"], out["abs_diff_max"] = diff.float().mean().item(), int(diff.max())
    return out


def concurrency(decode: Callable[[], object], threads: int, per_thread: int) -> dict[str, float]:
    """``threads`` threads decoding ``per_thread`` videos each at once (the server prepares requests in 4):
    videos a second, and the process's CPU seconds a video (every thread's, FFmpeg's own included)."""
    decode()  # each path warmed (the main thread's decoder; each worker makes its own in the first round)
    arrived = threading.Barrier(threads)

    def warm(_: int) -> None:
        decode()
        arrived.wait()  # one warm-up a worker: no worker makes its decoder inside the timed round

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(warm, range(threads)))
        wall, cpu = time.perf_counter(), time.process_time()
        list(pool.map(lambda _: decode(), range(threads * per_thread)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    videos = threads * per_thread
    return {"videos_per_s": videos / wall, "cpu_s_per_video": cpu / videos, "videos": videos}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--size", default="854x480", help="WIDTHxHEIGHT")
    p.add_argument("--num-frames", type=int, default=DEFAULT_NUM_FRAMES, help="frames g4serve samples")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=4, help="threads decoding at once (0: not measured)")
    p.add_argument("--per-thread", type=int, default=6, help="videos each thread decodes, timed")
    p.add_argument("--out", default="bench/results/nvdec-probe")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    clip = make_clip(args.seconds, args.fps, width, height)
    report: dict[str, object] = result_header("nvdec_probe", "cuda" if torch.cuda.is_available() else "cpu")
    report["clip"] = {"bytes": len(clip), "seconds": args.seconds, "fps": args.fps, "size": args.size}
    report["host_load_video"], video = timed(lambda: load_video(clip, num_frames=args.num_frames), args.reps)
    host_frames = np.asarray(video.frames)  # type: ignore[attr-defined]
    report["host_frames_shape"] = list(host_frames.shape)
    if torch.cuda.is_available():
        report["nvcuvid"] = nvcuvid()
        report["nvdec"] = probe_nvdec(clip, host_frames, args.num_frames, args.reps)
        if report["nvdec"].get("imports"):
            report["g4serve_nvdec"] = probe_g4serve(clip, host_frames, args.num_frames, args.reps)
        if args.threads and "error" not in report.get("g4serve_nvdec", {"error": 1}):
            host = lambda: load_video(clip, num_frames=args.num_frames)  # noqa: E731
            report["concurrent"] = {
                "threads": args.threads,
                "host": concurrency(host, args.threads, args.per_thread),
                "g4serve_nvdec": concurrency(
                    lambda: g4serve_nvdec(clip, args.num_frames), args.threads, args.per_thread
                ),
            }
    for key in (
        "clip",
        "host_load_video",
        "host_frames_shape",
        "nvcuvid",
        "nvdec",
        "g4serve_nvdec",
        "concurrent",
    ):
        if key in report:
            print(f"{key}: {json.dumps(report[key], default=str)}")
    write_result_json(args.out, "nvdec_probe", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
