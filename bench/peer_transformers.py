"""The transformers peer: Hugging Face's own Gemma 4 text model on a preset's shapes, random weights.

    python3 bench/peer_transformers.py --preset e4b --device cuda --out $OUT \\
        [--eager-batches 1,8] [--batches 1,8] [--time-budget-s 150] [--no-compile] [--compile]

Measures what `bench/engine_microbench.py` measures for g4serve, with transformers' `generate`:
decode time per token at batch B (a B x 128-token prompt, then `--decode-tokens` new tokens with a
static cache: (t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1)), and TTFT (prefill plus one
token) for one prompt of L tokens.

On CUDA, transformers' `generate` compiles the decoding forward by itself for a static cache
(`torch.compile`, mode reduce-overhead: CUDA graphs; the JSON records dynamo's graph count). The rows of
`--batches` use that; the rows of `--eager-batches` pass `disable_compile=True` (static cache, eager
forward) and cost no compilation, as does every prefill row (the prefill forward is never compiled).
`--no-compile` makes every row eager. `--compile` additionally wraps the forward in
`torch.compile(mode="reduce-overhead")` (on transformers 5.17 that path fails: its static cache
overwrites a CUDA-graph output).

Rows run cheapest first: eager decode rows, prefill rows, then the compiled decode rows, one batch size at a
time (each new batch size compiles anew: the 270 s device run of 2026-11-23 spent its last ~100 s on batch 8
without finishing). A decode row's long and short calls use one static-cache size (`max_cache_len`), so they
share one compiled graph; before, each compiled twice. `--time-budget-s` bounds the whole run: a row that
would start after the budget is skipped, and a row still running when it ends is interrupted; both are listed
under `skipped`. The JSON is rewritten after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import signal
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from g4serve.bench.meta import command_line, git_commit


def build(preset_name: str, device: str, dtype: torch.dtype, seed: int):
    import transformers
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from g4serve.config import preset

    cfg = Gemma4TextConfig(
        **{k: v for k, v in preset(preset_name).text.to_hf_dict().items() if k != "model_type"}
    )
    cfg._attn_implementation = "sdpa"
    with torch.device(device):  # built where it runs: buffers (RoPE tables, scales) come out right
        model = Gemma4ForCausalLM(cfg).to(dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():  # the same weight recipe as g4serve's presets (loader.init_random_weights)
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(param.shape[0] ** -0.25)
            elif param.ndim <= 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval(), transformers.__version__


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(
    model,
    ids: torch.Tensor,
    new_tokens: int,
    device: str,
    *,
    compiled: bool = True,
    max_cache_len: int | None = None,
) -> float:
    """One ``generate`` call with a static cache; ``max_cache_len`` sizes that cache the same for calls of
    different lengths, so that they share one cache and one compiled graph."""
    sync(device)
    t0 = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
        disable_compile=not compiled,
        max_cache_len=max_cache_len,
    )
    sync(device)
    return time.perf_counter() - t0


def _caused_by(exc: BaseException | None, kind: type) -> bool:
    """Whether ``exc`` or an exception it was raised from / during is a ``kind`` (or names it: inductor
    re-raises errors from inside a compile as ``InductorError("RowTimeout: ...")``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind) or str(exc).startswith(f"{kind.__name__}:"):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class RowTimeout(Exception):
    pass


@contextmanager
def deadline(seconds: float | None):
    """Raise RowTimeout in the main thread after ``seconds`` (None: no limit)."""
    if seconds is None:
        yield
        return

    def expire(signum, frame):
        raise RowTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - benchmark main: its argparse options, the row closures sharing the run's state, three row loops
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="e4b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8", help="decode rows with generate's own compilation (CUDA)")
    p.add_argument("--eager-batches", default="", help="decode rows with disable_compile=True, run first")
    p.add_argument("--decode-tokens", type=int, default=17)
    p.add_argument("--prefill-lengths", default="128,512,2048")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="every row eager (disable_compile=True)")
    p.add_argument(
        "--compile", action="store_true", help="also wrap the forward in torch.compile(reduce-overhead)"
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop starting rows after this many seconds from the start, and interrupt a row still "
        "running then (default: no limit)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.decode_tokens < 2:
        p.error("--decode-tokens: need at least 2")

    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model, tf_version = build(args.preset, args.device, dtype, args.seed)
    if args.compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    load_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    print(
        f"transformers {tf_version}: {args.preset} on {args.device} ({args.dtype}) built in {load_s:.1f}s",
        flush=True,
    )

    decode: list[dict] = []
    prefill: list[dict] = []
    skipped: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = out / f"peer-transformers-{args.preset}-{'compiled' if args.compile else 'generate'}-{stamp}.json"

    def save() -> None:  # after every row, so a run cut short by a time limit keeps what it measured
        from torch._dynamo.utils import counters

        result = {
            "benchmark": "peer_transformers",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "command": command_line(),
            "preset": args.preset,
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
            "torch": torch.__version__,
            "transformers": tf_version,
            "python": platform.python_version(),
            "compile": args.compile,
            "cache": "static",
            "attn_implementation": "sdpa",
            "load_s": load_s,
            "decode_tokens": args.decode_tokens,
            "reps": args.reps,
            "time_budget_s": args.time_budget_s,
            "elapsed_s": time.perf_counter() - start,
            # transformers compiles the decoding forward itself for static caches on CUDA: record whether it
            # did
            "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
            "decode": decode,
            "prefill": prefill,
            "skipped": skipped,
        }
        path.write_text(json.dumps(result, indent=2))

    def run_row(what: dict, measure) -> dict | None:
        left = None if args.time_budget_s is None else args.time_budget_s - (time.perf_counter() - start)
        if left is not None and left <= 0:
            skipped.append({**what, "reason": "time budget spent before the row started"})
            save()
            print(f"skipped {what}: time budget spent", flush=True)
            return None
        t0 = time.perf_counter()
        try:
            with deadline(left):
                row = {**what, **measure(), "row_s": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 - torch.compile wraps the RowTimeout raised inside it
            if not _caused_by(exc, RowTimeout):
                raise
            skipped.append(
                {**what, "reason": f"interrupted at the time budget after {time.perf_counter() - t0:.0f} s"}
            )
            save()
            print(f"interrupted {what} after {time.perf_counter() - t0:.0f} s (time budget)", flush=True)
            return None
        return row

    def measure_decode(b: int, compiled: bool):
        ids = torch.randint(1000, vocab, (b, 128), generator=gen).to(args.device)

        # The long and the short call share one cache size: one compilation per batch size, not two.
        run = functools.partial(
            timed_generate,
            model,
            ids,
            device=args.device,
            compiled=compiled,
            max_cache_len=ids.shape[1] + args.decode_tokens,
        )

        def measure() -> dict:
            for _ in range(2):  # warm-up (and compilation)
                run(args.decode_tokens)
                run(1)
            per_token = []
            for _ in range(args.reps):
                long = run(args.decode_tokens)
                short = run(1)
                per_token.append((long - short) / (args.decode_tokens - 1))
            return {
                "itl_p50_ms": 1e3 * statistics.median(per_token),
                "output_tokens_per_s": b / statistics.median(per_token),
            }

        return measure

    compiled_batches = [] if args.no_compile else _ints(args.batches)
    eager_batches = _ints(args.eager_batches) + (_ints(args.batches) if args.no_compile else [])
    for b in eager_batches:
        row = run_row(
            {"batch": b, "prompt_tokens": 128, "compiled": False}, measure_decode(b, compiled=False)
        )
        if row:
            decode.append(row)
            save()
            print(f"decode batch {b:3d} (eager): {row['itl_p50_ms']:.2f} ms/token", flush=True)
    for length in _ints(args.prefill_lengths):
        ids = torch.randint(1000, vocab, (1, length), generator=gen).to(args.device)

        def measure(ids=ids) -> dict:
            timed_generate(model, ids, 1, args.device, compiled=False)
            times = [timed_generate(model, ids, 1, args.device, compiled=False) for _ in range(args.reps)]
            return {"ttft_p50_ms": 1e3 * statistics.median(times)}

        row = run_row({"prompt_tokens": length}, measure)
        if row:
            prefill.append(row)
            save()
            print(f"prefill {length:5d}: TTFT {row['ttft_p50_ms']:.2f} ms", flush=True)
    for b in compiled_batches:
        row = run_row(
            {"batch": b, "prompt_tokens": 128, "compiled": args.device.startswith("cuda")},
            measure_decode(b, compiled=True),
        )
        if row:
            decode.append(row)
            save()
            print(
                f"decode batch {b:3d}: {row['itl_p50_ms']:.2f} ms/token "
                f"({row['row_s']:.0f} s with compilation)",
                flush=True,
            )
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
