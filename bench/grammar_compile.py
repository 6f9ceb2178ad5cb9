"""What one new structured-output grammar costs to compile: the reason new grammars compile on threads of
their own (``AsyncLLMEngine``'s "g4-grammar" threads, at most ``COMPILES_WAITING`` at once) and not in the
pool that tokenizes and decodes media for every request.

Each spec goes through g4serve's own checks and grammar (``StructuredSpec.from_response_format``,
``spec.build_grammar``), then xgrammar's compiler as the server runs it (2 threads, its cache off), over a
synthetic vocabulary: ``--vocab`` random tokens of 1-8 characters (letters, digits, space and JSON's
punctuation), seeded. Gemma 4's own vocabulary holds 262,144 tokens; its compile times differ from these,
the growth with the schema's bounds is the point.

    python bench/grammar_compile.py                       # 262,144 tokens, one compile a spec
    python bench/grammar_compile.py --vocab 32768 --reps 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import xgrammar as xgr  # noqa: E402

from g4serve.bench.meta import result_header, write_result_json  # noqa: E402
from g4serve.structured import StructuredSpec  # noqa: E402
from g4serve.structured.spec import build_grammar  # noqa: E402


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


def _object(**properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


SPECS: dict[str, dict] = {
    "object of a string and an integer": _schema(_object(a={"type": "string"}, b={"type": "integer"})),
    "string, maxLength 10": _schema(_object(a={"type": "string", "maxLength": 10})),
    "string, maxLength 100": _schema(_object(a={"type": "string", "maxLength": 100})),
    "string, maxLength 1000": _schema(_object(a={"type": "string", "maxLength": 1000})),
    "string, minLength 1000": _schema(_object(a={"type": "string", "minLength": 1000})),
    "100 optional string properties": _schema(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    ),
    "regex [a-z]{0,1000}": {"type": "regex", "regex": "[a-z]{0,1000}"},
}


def vocabulary(size: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + ' {}[]":,'
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(size)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=262_144, help="tokens in the synthetic vocabulary")
    p.add_argument("--reps", type=int, default=1, help="compiles a spec (the median is reported)")
    p.add_argument("--specs", default=None, help="comma-separated names of SPECS to run (default: all)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    began = time.perf_counter()
    info = xgr.TokenizerInfo(vocabulary(args.vocab), vocab_size=args.vocab, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # as the server's backend
    print(f"vocabulary of {args.vocab} tokens ready in {time.perf_counter() - began:.1f} s", flush=True)
    names = args.specs.split(",") if args.specs else list(SPECS)
    rows = []
    for name in names:
        spec = StructuredSpec.from_response_format(SPECS[name])
        grammar = build_grammar(spec)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            compiler.compile_grammar(grammar)
            times.append(time.perf_counter() - t0)
        rows.append({"spec": name, "response_format": SPECS[name], "compile_s": times})
        print(f"{name:36s} {statistics.median(times):8.2f} s", flush=True)
    result = {**result_header("grammar_compile", "cpu"), "vocab": args.vocab, "reps": args.reps, "rows": rows}
    write_result_json(args.out, "grammar-compile", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
