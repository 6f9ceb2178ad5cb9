"""What serving LoRA adapters costs a decode step and a prefill: an engine without LoRA, then one with
``--max-loras`` slots, its requests on the base model, all on one adapter, or spread over every adapter.

    python bench/lora_decode.py --model e4b --device cuda --rank 16 --max-loras 4 --batches 1,8,32 \\
        --out bench/results

Adapters are random PEFT directories of the model's shapes on all seven projections (written here, so
the device needs no ``peft``). Decode: B requests prefilled, then ``--decode-steps`` engine steps timed
(ITL = step time, as ``engine_microbench.py``). Prefill: TTFT of one fresh ``--prefill-length`` prompt.
Writes one JSON with the device, versions, command and every figure with its unit.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_microbench import bench_decode, bench_prefill  # noqa: E402

from g4serve.bench.meta import command_line, git_commit, write_result_json  # noqa: E402
from g4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from g4serve.lora.synthetic import write_random_adapter  # noqa: E402


def run(engine: LLMEngine, args, modes: dict[str, list[str | None]]) -> dict:
    out = {"decode": [], "prefill": []}
    for salt, (name, adapters) in enumerate(modes.items()):
        for batch in args.batches:
            row = bench_decode(engine, batch, args.prompt_len, args.decode_steps, adapters=adapters)
            row.update(mode=name, adapters=adapters)
            out["decode"].append(row)
            print(f"{name:>10} batch {batch:3d}: ITL p50 {row['itl_p50_ms']:.3f} ms", flush=True)
        row = bench_prefill(engine, args.prefill_length, args.prefill_reps, lora=adapters[0], salt=salt)
        row.update(mode=name, lora=adapters[0])
        out["prefill"].append(row)
        print(f"{name:>10} prefill {args.prefill_length}: TTFT p50 {row['ttft_p50_ms']:.2f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="e4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--prefill-length", type=int, default=1024)
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    common = dict(model=args.model, device=args.device, text_only=True, max_num_seqs=max(args.batches))

    t0 = time.monotonic()
    engine = LLMEngine(EngineConfig(**common))
    results = {"no_lora_engine": run(engine, args, {"base": [None]})}
    text_cfg = engine.model_config.text
    del engine
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.max_loras)]
        modules = {
            n: str(write_random_adapter(Path(tmp) / n, text_cfg, args.rank, seed=i))
            for i, n in enumerate(names)
        }
        engine = LLMEngine(
            EngineConfig(**common, lora_modules=modules, max_loras=args.max_loras, max_lora_rank=args.rank)
        )
        modes = {"base": [None], "one": [names[0]], "mixed": names}
        results["lora_engine"] = run(engine, args, modes)
        slot_bytes = engine.lora.weights.num_bytes
    device = torch.device(args.device)
    result = {
        "command": command_line(),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "model": args.model,
        "rank": args.rank,
        "max_loras": args.max_loras,
        "lora_slot_bytes": slot_bytes,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "wall_s": time.monotonic() - t0,
        **results,
    }
    write_result_json(args.out, f"lora-decode-{args.model}-r{args.rank}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
