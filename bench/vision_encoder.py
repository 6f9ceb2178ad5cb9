"""Vision encoder latency: N video frames at a resolution through g4serve's vision tower and projection,
beside transformers' own Gemma 4 vision tower on the same patches (both random weights, same dtype).

    python3 bench/vision_encoder.py --model e4b --device cuda --frames 6 --size 854x480 --out $OUT

The frames go through g4serve's video processor (resize to the soft-token budget, patchify), as a
request's frames do; the timed region is the encoder alone (``Gemma4Model.encode_images``: tower,
pooling, projection to the text width), median of ``--reps`` after warm-up.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from g4serve.bench.meta import command_line, git_commit, write_result_json
from g4serve.processing.image import rescale_pixels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, reps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="e4b", help="preset or checkpoint dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--frames", type=int, default=6)
    p.add_argument("--size", default="854x480", help="frame WIDTHxHEIGHT")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip transformers' vision tower")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also write torch.profiler kernel tables of the engine's encoder (graph replay on CUDA) "
        "and of the eager one next to the JSON, after the timings",
    )
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    from g4serve.engine.engine import EngineConfig, LLMEngine

    width, height = (int(v) for v in args.size.lower().split("x"))
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=1,
            kv_cache_bytes=256 << 20,
            max_num_batched_tokens=2048,
            limit_mm_per_prompt={"image": 0, "video": 1, "audio": 0},
        )
    )
    device = engine.device
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(args.frames)]
    processed = engine.process_prompt({"prompt": "<|video|>", "multi_modal_data": {"video": [frames]}})
    item = processed.mm_items[0]
    pixels = rescale_pixels(item.data["pixel_values"].to(device), video=True).to(engine.dtype)
    positions = item.data["position_ids"].to(device)
    soft_tokens = sum(e - s for s, e in item.spans)
    print(
        f"{args.frames} frames {width}x{height} -> pixel_values {tuple(pixels.shape)}, "
        f"{soft_tokens} soft tokens",
        flush=True,
    )

    with torch.inference_mode():
        positions_cpu = item.data["position_ids"]  # as the engine passes them: kept cells chosen on the host
        ours = _time(
            lambda: engine.encoder.encode_images(pixels, positions, positions_cpu), device, args.reps
        )
        eager = _time(lambda: engine.model.encode_images(pixels, positions), device, args.reps)
    rows = {
        "g4serve": {
            "median_ms": 1e3 * statistics.median(ours),
            "min_ms": 1e3 * min(ours),
            "cuda_graph": engine.encoder.vision_graphs is not None,
        },
        "g4serve_eager": {"median_ms": 1e3 * statistics.median(eager), "min_ms": 1e3 * min(eager)},
    }
    print(f"g4serve eager encode_images: median {rows['g4serve_eager']['median_ms']:.2f} ms", flush=True)
    print(f"g4serve encode_images: median {rows['g4serve']['median_ms']:.2f} ms", flush=True)

    if args.peer:
        import transformers
        from transformers import Gemma4VisionConfig, Gemma4VisionModel

        cfg = Gemma4VisionConfig(
            **{k: v for k, v in engine.model_config.vision.to_hf_dict().items() if k != "model_type"}
        )
        cfg._attn_implementation = "sdpa"
        with torch.device(device):
            tower = Gemma4VisionModel(cfg).to(engine.dtype).eval()
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for param in tower.parameters():
                param.normal_(0.0, 0.02, generator=gen)
        with torch.inference_mode():
            theirs = _time(
                lambda: tower(pixel_values=pixels, pixel_position_ids=positions), device, args.reps
            )
        rows["transformers"] = {
            "median_ms": 1e3 * statistics.median(theirs),
            "min_ms": 1e3 * min(theirs),
            "version": transformers.__version__,
            "attn_implementation": "sdpa",
            "note": "vision tower only (no projection to the text width)",
        }
        print(
            f"transformers Gemma4VisionModel: median {rows['transformers']['median_ms']:.2f} ms", flush=True
        )

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    result = {
        "benchmark": "vision_encoder",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": command_line(),
        "device": name,
        "torch": torch.__version__,
        "model": args.model,
        "dtype": str(engine.dtype),
        "frames": args.frames,
        "frame_size": f"{width}x{height}",
        "pixel_values_shape": list(pixels.shape),
        "soft_tokens": soft_tokens,
        "reps": args.reps,
        "results": rows,
    }
    path = write_result_json(args.out, f"vision-{Path(args.model).name}-{device.type}", result)
    if args.profile:  # last: the profiler stays attached and slows later launches
        for label, fn in (
            ("runner", lambda: engine.encoder.encode_images(pixels, positions, positions_cpu)),
            ("eager", lambda: engine.model.encode_images(pixels, positions)),
        ):
            table = _profile(fn, device)
            path.with_suffix(f".profile-{label}.txt").write_text(table)
            print(f"wrote {path.with_suffix(f'.profile-{label}.txt')}")
    return 0


def _profile(fn, device: torch.device, reps: int = 5) -> str:
    """Kernel table (self device time, descending) of ``reps`` calls of ``fn``, per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        fn()
        _sync(device)
        with profile(activities=activities) as prof:
            for _ in range(reps):
                fn()
            _sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return f"{reps} calls\n" + prof.key_averages().table(sort_by=sort, row_limit=40)


if __name__ == "__main__":
    raise SystemExit(main())
