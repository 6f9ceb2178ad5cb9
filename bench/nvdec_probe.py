"""Can a served video container be decoded on the GPU (NVDEC), and what would it save? The first step of
issue 23's "video decoding with NVDEC where the container allows", run before any of it is built.

On the machine it runs on it reports (a line each, and JSON under ``--out``):

- whether the driver's NVDEC library (``libnvcuvid.so.1``) loads, and whether PyNvVideoCodec (NVIDIA's
  Video Codec SDK bindings, a PyPI wheel: ``bench/device/nvdec_probe.sh`` carries it) imports;
- a clip made here with PyAV: ``--seconds`` of ``--size`` H.264 (yuv420p) at ``--fps`` in MP4, from moving
  synthetic frames;
- the host path: g4serve's ``load_video`` on the clip's bytes (PyAV decodes up to the last sampled frame),
  median and minimum ms;
- NVDEC: ``PyNvVideoCodec.SimpleDecoder`` on the same bytes, from memory, RGB on the device, the frames
  g4serve samples (``sample_frame_indices`` over the decoder's frame count), with and without creating the
  decoder;
- how close the two are: mean and maximum absolute difference of the sampled frames (the colour conversion
  and chroma upsampling differ, so a few levels are expected; a different frame would differ by far more).

Every stage that fails is reported with its error and the rest still runs, so one call answers what is
there. On a machine without a GPU only the clip and the host path run:

    python bench/nvdec_probe.py --out bench/results/nvdec-probe
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import statistics
import sys
import time
from collections.abc import Callable

import av
import numpy as np
import torch

from g4serve.bench.meta import result_header, write_result_json
from g4serve.processing.video import DEFAULT_NUM_FRAMES, load_video, sample_frame_indices


def make_clip(seconds: float, fps: int, width: int, height: int) -> bytes:
    """An H.264 MP4 of moving gradients and a moving square (every frame differs from its neighbours)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        ys, xs = np.mgrid[0:height, 0:width]
        for i in range(int(seconds * fps)):
            rgb = np.stack([(xs + 3 * i) % 256, (ys + 2 * i) % 256, (xs + ys + i) % 256], -1).astype(np.uint8)
            x0 = (7 * i) % max(1, width - 64)
            rgb[40:104, x0 : x0 + 64] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


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


def nv12_to_rgb(nv12: torch.Tensor, height: int) -> torch.Tensor:
    """uint8 [H, W, 3] from an NV12 surface [H * 3 / 2, W] (BT.601, limited range: what swscale assumes for an
    untagged yuv420p stream, so what the host's ``to_ndarray("rgb24")`` computes, up to rounding)."""
    y = nv12[:height].float() - 16.0
    uv = nv12[height:].view(height // 2, -1, 2).float() - 128.0
    uv = uv.repeat_interleave(2, 0).repeat_interleave(2, 1)[:height, : y.shape[1]]
    u, v = uv[..., 0], uv[..., 1]
    r = 1.164 * y + 1.596 * v
    g = 1.164 * y - 0.392 * u - 0.813 * v
    b = 1.164 * y + 2.017 * u
    return torch.stack([r, g, b], -1).round().clamp(0, 255).to(torch.uint8)


def _decoder(nvc, codec) -> tuple[object, str]:
    """An NVDEC decoder for ``codec`` with device output: RGB where this version takes outputColorType."""
    common = {"gpuid": 0, "codec": codec, "cudacontext": 0, "cudastream": 0, "usedevicememory": True}
    try:
        return nvc.CreateDecoder(**common, outputColorType=nvc.OutputColorType.RGB), "rgb"
    except Exception:  # noqa: BLE001 - older signatures: NV12 output, converted here
        return nvc.CreateDecoder(**common), "nv12"


def _packet(nvc, data, pts):
    pkt = nvc.PacketData()
    if data is not None:
        pkt.bsl_data, pkt.bsl = data.buffer_ptr, data.size
        pkt.pts = pts if pts is not None else 0
    return pkt


def packet_frames(nvc, clip: bytes, num_frames: int) -> tuple[torch.Tensor, list[int], str, int]:
    """The intended design: g4serve's PyAV demuxer (allowed demuxers only, no protocols) hands H.264 packets,
    as Annex B (``h264_mp4toannexb``), to an NVDEC decoder. Returns the sampled frames on the GPU, their
    indices, the output format and how many frames came out."""
    import av.bitstream

    from g4serve.processing.video import _open

    with _open(clip) as container:
        stream = container.streams.video[0]
        height, total = stream.codec_context.height, stream.frames
        wanted = set(sample_frame_indices(total, num_frames))
        decoder, fmt = _decoder(nvc, nvc.cudaVideoCodec.H264)
        bsf = av.bitstream.BitStreamFilterContext("h264_mp4toannexb", stream)
        picked: dict[int, torch.Tensor] = {}
        count = 0

        def take(frames) -> None:
            nonlocal count
            for frame in frames:
                if count in wanted:
                    t = torch.as_tensor(frame, device="cuda")
                    picked[count] = (t if fmt == "rgb" else nv12_to_rgb(t, height)).clone()
                count += 1

        for packet in container.demux(stream):
            for annexb in bsf.filter(packet if packet.size else None):
                take(decoder.Decode(_packet(nvc, annexb, annexb.pts)))
        take(decoder.Decode(_packet(nvc, None, None)))  # an empty packet flushes the decoder
    indices = sorted(picked)
    return torch.stack([picked[i] for i in indices]), indices, fmt, count


def probe_packets(nvc, clip: bytes, host_frames: np.ndarray, num_frames: int, reps: int) -> dict[str, object]:
    out: dict[str, object] = {
        "packet_data_fields": [m for m in dir(nvc.PacketData()) if not m.startswith("_")],
        "create_decoder_doc": (nvc.CreateDecoder.__doc__ or "")[:1500],
    }
    try:
        timing, result = timed(lambda: packet_frames(nvc, clip, num_frames), reps)
    except Exception as exc:  # noqa: BLE001 - reported with the introspection above
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    frames, indices, fmt, count = result
    out.update(timing=timing, output=fmt, frames_out=count, sampled=len(indices), shape=list(frames.shape))
    if tuple(frames.shape) == host_frames.shape:
        diff = (frames.cpu().int() - torch.from_numpy(host_frames).int()).abs()
        out["abs_diff_mean"], out["abs_diff_max"] = diff.float().mean().item(), int(diff.max())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--size", default="854x480", help="WIDTHxHEIGHT")
    p.add_argument("--num-frames", type=int, default=DEFAULT_NUM_FRAMES, help="frames g4serve samples")
    p.add_argument("--reps", type=int, default=10)
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
            import PyNvVideoCodec as nvc  # noqa: N813 - the package's own name

            report["nvdec_packets"] = probe_packets(nvc, clip, host_frames, args.num_frames, args.reps)
    for key in ("clip", "host_load_video", "host_frames_shape", "nvcuvid", "nvdec", "nvdec_packets"):
        if key in report:
            print(f"{key}: {json.dumps(report[key], default=str)}")
    write_result_json(args.out, "nvdec_probe", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
