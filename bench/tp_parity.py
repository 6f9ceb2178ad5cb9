"""Greedy tokens of one model at several tensor-parallel sizes, side by side (issue 25: 31B at TP = 2 against
TP = 1 on the same random weights). Each size runs in turn (the previous engine and its workers are stopped
first); the report gives, per prompt, how many leading tokens equal the first size's, and the JSON keeps every
token. In bf16 the ranks' partial sums round in another order, so a random-weight model's near-tied argmaxes
may part after a while; in fp32 (``--dtype float32``) they should not.

    python3 bench/tp_parity.py --model 31b --sizes 1,2 --max-tokens 32
    python3 bench/tp_parity.py --sizes 1,2 --device cpu          # the tiny model over gloo (a smoke test)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from g4serve import LLM, SamplingParams  # noqa: E402
from g4serve.bench.meta import command_line, device_name, git_commit, write_result_json  # noqa: E402

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Translate to French: the weather is lovely today, so",
    "Q: What is the capital of Australia?\nA:",
]


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="preset or checkpoint dir (default: the embedded tiny model)"
    )
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens: dict[int, list[list[int]]] = {}
    load_s: dict[int, float] = {}
    for size in sizes:
        t0 = time.perf_counter()
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            text_only=True,
            tensor_parallel_size=size,
            max_model_len=args.max_model_len,
        )
        load_s[size] = time.perf_counter() - t0
        tokens[size] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"TP {size}: loaded and warmed up in {load_s[size]:.1f} s", flush=True)
    base = sizes[0]
    print(f"| TP | leading tokens equal to TP {base}'s, per prompt (of {args.max_tokens}) | start-up (s) |")
    print("|---|---|---:|")
    for size in sizes:
        equal = [_prefix(a, b) for a, b in zip(tokens[base], tokens[size])]
        print(f"| {size} | {' / '.join(map(str, equal))} | {load_s[size]:.1f} |")
    result = {
        "git_commit": git_commit(),
        "device_name": device_name(None if args.device == "auto" else args.device),
        "torch_version": torch.__version__,
        "command": command_line(),
        "model": args.model or "tiny",
        "dtype": args.dtype,
        "prompts": PROMPTS,
        "tokens": {str(k): v for k, v in tokens.items()},
        "startup_s": {str(k): v for k, v in load_s.items()},
    }
    write_result_json(args.out, f"tp-parity-{(args.model or 'tiny').replace('/', '_')}", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
