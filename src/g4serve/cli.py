"""Command line: ``g4serve serve | assistant | bench | generate | make-tiny``."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or preset (tiny, e2b, e4b, 26b-a4b, 31b); "
        "default: the embedded tiny model",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--text-only", action="store_true", help="do not load the vision/audio towers")


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from g4serve.tiny import make_tiny

    t0 = time.perf_counter()
    out = make_tiny(args.dir, variant=args.variant, seed=args.seed)
    print(f"wrote tiny Gemma 4 ({args.variant}) checkpoint to {out} in {time.perf_counter() - t0:.2f}s")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from g4serve import LLM, SamplingParams

    # Sampling options first: a typo there should not cost a model load.
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, text_only=args.text_only)
    content: list[dict] = []
    for path in args.image or []:
        content.append({"type": "image", "image": path})
    for path in args.video or []:
        content.append({"type": "video", "video": path})
    for path in args.audio or []:
        content.append({"type": "audio", "audio": path})
    t0 = time.perf_counter()
    if args.raw:
        out = llm.generate([args.prompt], params)[0]
    else:
        content.append({"type": "text", "text": args.prompt})
        out = llm.chat([{"role": "user", "content": content}], params)[0]
    elapsed = time.perf_counter() - t0
    completion = out.outputs[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "elapsed_s": elapsed,
                }
            )
        )
    else:
        print(completion.text)
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
            f"finish={completion.finish_reason}, {elapsed:.2f}s]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="g4serve", description="Fast serving for the Gemma 4 family.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    from g4serve.server.launch import add_serve_arguments, serve

    add_serve_arguments(p)
    p.set_defaults(func=serve)

    p = sub.add_parser("assistant", help="serve the voice banking assistant (HTTP, WebSocket, web page)")
    from g4serve.assistant.cli import add_assistant_arguments

    add_assistant_arguments(p)

    from g4serve.bench.cli import add_bench_arguments

    add_bench_arguments(sub)

    p = sub.add_parser("make-tiny", help="write a tiny random Gemma 4 checkpoint")
    p.add_argument("dir")
    p.add_argument(
        "--variant", default="e", help="e (E2B/E4B-like, default), moe (26B-A4B-like), 31b (31B-like)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("generate", help="generate one completion offline")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="use the prompt as-is instead of the chat template")
    p.add_argument("--image", action="append", help="image file (repeatable)")
    p.add_argument("--video", action="append", help="video file (repeatable)")
    p.add_argument("--audio", action="append", help="audio file (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"g4serve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
