"""Request preprocessing on the CPU: what a video (or image) request costs before it reaches the engine.

Builds the benchmark's video request (``g4serve bench --workload video``: six 854x480 JPEG frames as data
URLs, seeded), then times, median and minimum of ``--reps`` after warm-up: the whole path the server runs off
the event loop (JSON body -> chat parts -> chat template -> ``LLMEngine.process_prompt``), and its pieces
(decoding the frames serially and in the media pool, frames to HWC arrays, the resize to the patch budget
as the processor runs it (frames side by side in the media pool) and in one call, the sampled frames'
decoding and HWC conversion together in the pool, patchify and the content hash of the uint8 patches the
processor now keeps, and the rescale to float32, patchify and hash as it did before). ``--device cuda``
also times the GPU path (``--media-on-gpu``): the whole request through it, and its pieces (the frames
decoded by nvJPEG in one batched call, the host frames' upload, the float resize, patchify, and the content
hash reading the patches back), each synchronised. Writes JSON with the machine, commit and command.

    python bench/preprocess_media.py                 # the embedded tiny model's processor settings
    python bench/preprocess_media.py --frames 6 --size 854x480 --reps 30
    python bench/preprocess_media.py --device cuda   # and the GPU path beside it
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import io
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms.v2 import functional as tvF

from g4serve.bench.meta import command_line, device_name, git_commit, write_result_json
from g4serve.bench.workloads import VideoWorkload
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.processing.chat import split_chat_messages
from g4serve.processing.device_media import DeviceMedia
from g4serve.processing.image import load_image, patchify, rescale_pixels, resize_to_patch_budget
from g4serve.processing.limits import MediaBudget
from g4serve.processing.processor import Gemma4Processor, _decode_all, content_hash
from g4serve.processing.video import _frame_to_hwc, sample_video_frames

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--frames", type=int, default=6)
    p.add_argument("--size", default="854x480", help="frame WIDTHxHEIGHT")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--device", default=None, help="also time the GPU media path on this device (cuda)")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def timed_ms(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Median and minimum of ``reps`` calls after 3 warm-up calls (on a shared machine the minimum is the
    steadier figure)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": 1e3 * statistics.median(times), "min": 1e3 * min(times)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = VideoWorkload(num_frames=args.frames, frame_size=args.size)
    request = workload.build(random.Random(0), 10)
    body = json.dumps({"messages": request.messages})
    engine = LLMEngine(EngineConfig(device="cpu"))
    settings = engine.processor.settings

    def whole_request(processor: Gemma4Processor = engine.processor):
        messages, media = split_chat_messages(json.loads(body)["messages"], allow_local_files=False)
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return processor.process(
            {"prompt": prompt, "multi_modal_data": media.as_dict()},
            engine.config.limit_mm_per_prompt,
            add_special_tokens=False,
            media_limits=engine.media_limits,
        )

    jpegs = []
    for frame in workload.frames(random.Random(0)):
        buf = io.BytesIO()
        frame.save(buf, format="JPEG", quality=90)
        jpegs.append(buf.getvalue())
    images = [load_image(b) for b in jpegs]
    frames = torch.from_numpy(np.stack([_frame_to_hwc(im) for im in images])).permute(0, 3, 1, 2)
    max_patches = settings.video_max_soft_tokens * settings.pooling_kernel_size**2
    resized = resize_to_patch_budget(frames, settings.patch_size, max_patches, settings.pooling_kernel_size)
    patches, positions = patchify(resized, settings.patch_size, max_patches)
    float_patches = rescale_pixels(patches, video=True)

    rows = {
        "whole_request_ms": timed_ms(whole_request, args.reps),
        "decode_frames_serial_ms": timed_ms(lambda: [load_image(b) for b in jpegs], args.reps),
        "decode_frames_threads_ms": timed_ms(lambda: _decode_all(load_image, jpegs), args.reps),
        "frames_to_hwc_ms": timed_ms(lambda: [_frame_to_hwc(im) for im in images], args.reps),
        "resize_channels_last_ms": timed_ms(
            lambda: resize_to_patch_budget(
                frames, settings.patch_size, max_patches, settings.pooling_kernel_size
            ),
            args.reps,
        ),
        "resize_one_call_ms": timed_ms(  # all frames in one call of torch's uint8 kernel (one thread)
            lambda: tvF.resize(
                frames.contiguous(memory_format=torch.channels_last),
                size=list(resized.shape[-2:]),
                interpolation=tvF.InterpolationMode.BICUBIC,
                antialias=True,
            ),
            args.reps,
        ),
        "resize_planar_input_ms": timed_ms(
            lambda: resize_to_patch_budget(
                frames.contiguous(), settings.patch_size, max_patches, settings.pooling_kernel_size
            ),
            args.reps,
        ),
        "patchify_uint8_ms": timed_ms(lambda: patchify(resized, settings.patch_size, max_patches), args.reps),
        "rescale_and_patchify_float32_ms": timed_ms(  # the processor's path before it kept uint8 patches
            lambda: patchify(rescale_pixels(resized, video=True), settings.patch_size, max_patches), args.reps
        ),
        "content_hash_uint8_ms": timed_ms(lambda: content_hash("video", patches, positions), args.reps),
        "content_hash_float32_ms": timed_ms(
            lambda: content_hash("video", float_patches, positions), args.reps
        ),
    }
    if "load" in inspect.signature(sample_video_frames).parameters:  # absent on sources before the media pool
        rows["sample_decode_hwc_pool_ms"] = timed_ms(
            lambda: sample_video_frames(jpegs, load=load_image), args.reps
        )
    if args.device:
        rows.update(device_rows(args, engine, whole_request, jpegs, frames, resized, positions))
    print(f"{'piece':32s} {'median':>8s} {'min':>8s}")
    for name, value in rows.items():
        print(f"{name:32s} {value['median']:8.2f} {value['min']:8.2f}")
    env = {
        "git_commit": git_commit(),
        "device_name": device_name("cpu"),
        "media_device_name": device_name(args.device) if args.device else None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "command": command_line(),
        "timestamp_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    write_result_json(
        args.out_dir,
        "preprocess_media",
        {
            "environment": env,
            "workload": workload.params(),
            "reps": args.reps,
            "units": {"*_ms": "milliseconds per call (median and min)"},
            "results": rows,
        },
    )
    return 0


def device_rows(
    args, engine, whole_request, jpegs, frames, resized, positions
) -> dict[str, dict[str, float]]:
    """The GPU path's whole request and pieces, each call synchronised (``gpu_*`` rows)."""
    device = torch.device(args.device)
    settings = engine.processor.settings
    processor = Gemma4Processor(engine.tokenizer, engine.model_config, settings, media_device=device)
    media = DeviceMedia(device)
    sizes = [media.jpeg_size(b, MediaBudget().limits) for b in jpegs]
    max_patches = settings.video_max_soft_tokens * settings.pooling_kernel_size**2
    on_device = frames.to(device)
    resized_on_device = resized.to(device)
    patches_on_device, _ = patchify(resized_on_device, settings.patch_size, max_patches)

    def synced(fn: Callable[[], object]) -> Callable[[], object]:
        def call():
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        return call

    return {
        "gpu_whole_request_ms": timed_ms(synced(lambda: whole_request(processor)), args.reps),
        "gpu_decode_frames_nvjpeg_ms": timed_ms(
            synced(lambda: media.decode(jpegs, sizes, MediaBudget())), args.reps
        ),
        "gpu_upload_frames_ms": timed_ms(synced(lambda: frames.to(device)), args.reps),
        "gpu_resize_float_ms": timed_ms(
            synced(
                lambda: resize_to_patch_budget(
                    on_device,
                    settings.patch_size,
                    max_patches,
                    settings.pooling_kernel_size,
                    float_resize=True,
                )
            ),
            args.reps,
        ),
        "gpu_patchify_ms": timed_ms(
            synced(lambda: patchify(resized_on_device, settings.patch_size, max_patches)), args.reps
        ),
        "gpu_content_hash_readback_ms": timed_ms(
            lambda: content_hash("video", patches_on_device, positions), args.reps
        ),
    }


if __name__ == "__main__":
    raise SystemExit(main())
