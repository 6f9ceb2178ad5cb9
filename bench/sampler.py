"""Sampling cost per decode step: ``layers/sampler.py`` on [B, vocab] logits for each filter setting.

What a step pays after the forward when its requests sample instead of taking the argmax: building the
``SamplingBatch`` (host parameters to the device) and ``sample`` (temperature, top-k / top-p / min-p,
the exponential race). The greedy benchmarks elsewhere never pay it. Top-k runs three ways: with its
``torch.topk`` candidates, forced through the sort of the whole vocabulary, and in the sort-free kernel's
radix select (``G4SERVE_SORT_FREE_TOP_K``, the "sort-free" rows); top-p and temperature alone
twice: through the sort-free kernel (CUDA) and through the torch masks and sort. On CUDA each setting the
chunked sampler takes (``kernels/chunked_sample.py``: top-k up to 128, with top-p and min-p; temperature and
min-p alone) runs once more through it (the ", chunked" rows; the others have it off). The logits are
``--dtype`` (bf16, as the model writes them). Median of ``--reps`` after warm-up, synchronised per call;
writes JSON (device, versions, commit) to bench/results/.

    python bench/sampler.py                                   # cuda, vocab 262144, B = 1 8 32 64
    python bench/sampler.py --device cpu --vocab 8192 --batches 1 8 --reps 5
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from g4serve.bench.meta import command_line, device_name, git_commit, write_result_json
from g4serve.layers import sampler
from g4serve.layers.sampler import SamplingBatch, sample
from g4serve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k=50": SamplingParams(temperature=0.8, top_k=50),
    "top_k=50, full sort": SamplingParams(temperature=0.8, top_k=50),
    "top_p=0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_p=0.9, sort": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k=50 top_p=0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_k=50, sort-free": SamplingParams(temperature=0.8, top_k=50),
    "top_k=64 top_p=0.95, sort-free": SamplingParams(temperature=1.0, top_k=64, top_p=0.95),
    "top_k=64 top_p=0.95": SamplingParams(temperature=1.0, top_k=64, top_p=0.95),
    "min_p=0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "temperature, sort path": SamplingParams(temperature=0.8),
}


def time_setting(
    params: SamplingParams,
    logits: torch.Tensor,
    reps: int,
    full_sort: bool,
    sort_free_top_k: bool = False,
    chunked: bool = False,
) -> float:
    """Median ms of one step's sampling (batch build + sample) over ``reps`` calls. ``full_sort``: top-k
    without its ``topk`` candidates, top-p and temperature through the torch masks and sort instead of the
    sort-free kernel. ``sort_free_top_k``: top-k in the sort-free kernel (``G4SERVE_SORT_FREE_TOP_K``).
    ``chunked``: the chunked sampler where it takes the batch (``G4SERVE_CHUNKED_SAMPLING``)."""
    device, batch = logits.device, logits.shape[0]
    rows = [params] * batch
    saved = (
        sampler.MAX_TOPK_CANDIDATES,
        sampler.SORT_FREE_TOP_P,
        sampler.SORT_FREE_TOP_K,
        sampler.CHUNKED_SAMPLING,
    )
    sampler.MAX_TOPK_CANDIDATES, sampler.SORT_FREE_TOP_P = (0, False) if full_sort else saved[:2]
    sampler.SORT_FREE_TOP_K = sort_free_top_k
    sampler.CHUNKED_SAMPLING = chunked
    try:
        times = []
        for rep in range(reps + 3):  # three warm-up calls
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            b = SamplingBatch.build(rows, [None] * batch, logits.shape[1], device)
            sample(logits, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep >= 3:
                times.append(time.perf_counter() - t0)
    finally:
        (
            sampler.MAX_TOPK_CANDIDATES,
            sampler.SORT_FREE_TOP_P,
            sampler.SORT_FREE_TOP_K,
            sampler.CHUNKED_SAMPLING,
        ) = saved
    return 1e3 * statistics.median(times)


def time_kernel(logits: torch.Tensor, reps: int, block: int) -> float:
    """Median ms of ``top_p_sample`` alone (top-p 0.9, temperature 0.8) with ``block`` logits per loop step,
    timed with CUDA events around each call."""
    from g4serve.kernels.top_p_sample import top_p_sample

    batch = logits.shape[0]
    temp, top_p, min_p = (torch.full((batch,), v, device=logits.device) for v in (0.8, 0.9, 0.0))
    noise = torch.empty(logits.shape, device=logits.device).exponential_()  # fp32, as the sampler draws it
    times = []
    for rep in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        top_p_sample(logits, temp, top_p, min_p, noise, block=block)
        end.record()
        end.synchronize()
        if rep >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_chunked(logits: torch.Tensor, reps: int, chunk: int, top_k: int) -> float:
    """Median ms of ``chunked_sample`` alone (temperature 1.0, top-k ``top_k`` with top-p 0.95, or temperature
    alone at 0) with ``chunk`` logits a program, timed with CUDA events around each call."""
    from g4serve.kernels.chunked_sample import chunked_sample

    batch, dev = logits.shape[0], logits.device
    ones, zeros = torch.ones(batch, device=dev), torch.zeros(batch, device=dev)
    ints = torch.arange(batch, device=dev)
    top_k_rows = torch.full((batch,), top_k, device=dev)
    top_p = torch.full((batch,), 0.95 if top_k else 1.0, device=dev)
    times = []
    for rep in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        chunked_sample(logits, ones, zeros, ints, ints, top_k_rows, top_p, top_k, chunk=chunk)
        end.record()
        end.synchronize()
        if rep >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=262144, help="Gemma 4's vocabulary")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--kernel-blocks",
        type=int,
        nargs="*",
        default=[],
        help="also time the top-p kernel alone (CUDA events) at these block sizes",
    )
    p.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        default=[],
        help="also time the chunked sampler alone (CUDA events) at these chunk sizes, top-k 64 and none",
    )
    p.add_argument(
        "--dtype", default="bfloat16", help="the logits' dtype (the model's, as the engine hands them)"
    )
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch in args.batches:
        # Peaked like a language model's logits: a few likely tokens over a long flat tail.
        logits = (torch.randn(batch, args.vocab, device=device, generator=gen) * 2.5).to(dtype)
        for name, params in SETTINGS.items():
            full_sort = name.endswith(("sort", "sort path"))
            sort_free = name.endswith("sort-free")
            ms = time_setting(params, logits, args.reps, full_sort, sort_free_top_k=sort_free)
            rows.append({"batch": batch, "setting": name, "ms": ms})
            print(f"B={batch:3d} {name:34s} {ms:8.3f} ms", flush=True)
            admitted = SamplingBatch.build([params], [None], args.vocab, "cpu").chunk_top_k is not None
            if device.type == "cuda" and admitted and not (full_sort or sort_free):
                ms = time_setting(params, logits, args.reps, False, chunked=True)
                rows.append({"batch": batch, "setting": f"{name}, chunked", "ms": ms})
                print(f"B={batch:3d} {name + ', chunked':34s} {ms:8.3f} ms", flush=True)
        for block in args.kernel_blocks if device.type == "cuda" else []:
            ms = time_kernel(logits, args.reps, block)
            rows.append({"batch": batch, "setting": f"top_p_sample kernel alone, block {block}", "ms": ms})
            print(f"B={batch:3d} kernel block {block:6d}    {ms:8.3f} ms", flush=True)
        for chunk, top_k in itertools.product(args.chunks if device.type == "cuda" else [], (64, 0)):
            ms = time_chunked(logits, args.reps, chunk, top_k)
            name = f"chunked_sample alone, chunk {chunk}, top_k {top_k}"
            rows.append({"batch": batch, "setting": name, "ms": ms})
            print(f"B={batch:3d} {name:34s} {ms:8.3f} ms", flush=True)

    result = {
        "benchmark": "sampler",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": command_line(),
        "device": device_name(args.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "vocab": args.vocab,
        "dtype": args.dtype,
        "reps": args.reps,
        "units": {"ms": "median milliseconds per step: SamplingBatch.build + sample, synchronised"},
        "results": rows,
    }
    write_result_json(args.out_dir, f"sampler-{args.device.replace(':', '')}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
