"""The transformers peer: Hugging Face's own Gemma 4 text model on a preset's shapes, random weights.

    python3 bench/peer_transformers.py --preset e4b --device cuda --out $OUT [--compile]

Measures what `bench/engine_microbench.py` measures for g4serve, with transformers' `generate`:
decode time per token at batch B (a B x 128-token prompt, then `--decode-tokens` new tokens with a
static cache: (t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1)), and TTFT (prefill plus one
token) for one prompt of L tokens. On CUDA, transformers' `generate` compiles the decoding forward by
itself for a static cache (the JSON records dynamo's graph count); `--compile` additionally wraps the
forward in `torch.compile(mode="reduce-overhead")` (on transformers 5.17 that path fails: its static
cache overwrites a CUDA-graph output). The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def build(preset_name: str, device: str, dtype: torch.dtype, seed: int):
    import transformers
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from g4serve.config import preset

    cfg = Gemma4TextConfig(**{k: v for k, v in preset(preset_name).text.to_hf_dict().items() if k != "model_type"})
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


def timed_generate(model, ids: torch.Tensor, new_tokens: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, cache_implementation="static", pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="e4b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--decode-tokens", type=int, default=33)
    p.add_argument("--prefill-lengths", default="128,512,2048")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, tf_version = build(args.preset, args.device, dtype, args.seed)
    if args.compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    print(f"transformers {tf_version}: {args.preset} on {args.device} ({args.dtype}) built in {load_s:.1f}s", flush=True)

    decode: list[dict] = []
    prefill: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = out / f"peer-transformers-{args.preset}-{'compiled' if args.compile else 'generate'}-{stamp}.json"

    def save() -> None:  # after every row, so a run cut short by a time limit keeps what it measured
        from torch._dynamo.utils import counters

        result = {
            "benchmark": "peer_transformers", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python3", *sys.argv]), "preset": args.preset, "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
            "torch": torch.__version__, "transformers": tf_version, "python": platform.python_version(),
            "compile": args.compile, "cache": "static", "attn_implementation": "sdpa", "load_s": load_s,
            # transformers compiles the decoding forward itself for static caches on CUDA: record whether it did
            "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
            "decode": decode, "prefill": prefill,
        }
        path.write_text(json.dumps(result, indent=2))

    for b in [int(x) for x in args.batches.split(",") if x]:
        ids = torch.randint(1000, vocab, (b, 128), generator=gen).to(args.device)
        for _ in range(2):  # warm-up (and compilation)
            timed_generate(model, ids, args.decode_tokens, args.device)
            timed_generate(model, ids, 1, args.device)
        per_token = []
        for _ in range(args.reps):
            long = timed_generate(model, ids, args.decode_tokens, args.device)
            short = timed_generate(model, ids, 1, args.device)
            per_token.append((long - short) / (args.decode_tokens - 1))
        row = {"batch": b, "prompt_tokens": 128, "itl_p50_ms": 1e3 * statistics.median(per_token),
               "output_tokens_per_s": b / statistics.median(per_token)}
        decode.append(row)
        save()
        print(f"decode batch {b:3d}: {row['itl_p50_ms']:.2f} ms/token", flush=True)
    for length in [int(x) for x in args.prefill_lengths.split(",") if x]:
        ids = torch.randint(1000, vocab, (1, length), generator=gen).to(args.device)
        timed_generate(model, ids, 1, args.device)
        times = [timed_generate(model, ids, 1, args.device) for _ in range(args.reps)]
        prefill.append({"prompt_tokens": length, "ttft_p50_ms": 1e3 * statistics.median(times)})
        save()
        print(f"prefill {length:5d}: TTFT {prefill[-1]['ttft_p50_ms']:.2f} ms", flush=True)

    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
