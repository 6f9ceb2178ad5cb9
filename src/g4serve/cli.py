"""Command line: ``g4serve serve | router | assistant | bench | generate | make-tiny``."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    from g4serve.engine_args import add_engine_arguments

    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or preset (tiny, e2b, e4b, 26b-a4b, 31b); "
        "default: the embedded tiny model",
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="use the prompt as-is instead of the chat template")
    p.add_argument("--image", action="append", help="image file (repeatable)")
    p.add_argument("--video", action="append", help="video file (repeatable)")
    p.add_argument("--audio", action="append", help="audio file (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    # --seed above is the sampling seed; a preset's random weights keep the engine's default seed.
    add_engine_arguments(p, exclude=("seed",))


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from g4serve.tiny import make_tiny

    t0 = time.perf_counter()
    out = make_tiny(args.dir, variant=args.variant, seed=args.seed)
    print(f"wrote tiny Gemma 4 ({args.variant}) checkpoint to {out} in {time.perf_counter() - t0:.2f}s")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from g4serve import LLM, SamplingParams
    from g4serve.engine_args import engine_config_from_args

    # Sampling options first: a typo there should not cost a model load.
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    llm = LLM.from_config(engine_config_from_args(args, model=args.model))
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


ASSISTANT_EXTRA_HINT = "the assistant needs its extra: pip install 'g4serve[assistant]'"


def _assistant_unavailable(args: argparse.Namespace) -> int:
    raise ValueError(f"{ASSISTANT_EXTRA_HINT} (missing: {args.assistant_missing})")


def _add_assistant_parser(sub: argparse._SubParsersAction) -> None:
    """``g4serve assistant``: the arguments of the separate ``g4serve_assistant`` package, imported here,
    when the parser is built, never when ``g4serve`` is (its ``cli`` module imports nothing of the
    ``assistant`` extra; its ``run`` refuses with the install hint when the extra is missing). Without the
    package at all, the subcommand takes any arguments (``main`` lets them through) and exits 2 with the same
    hint."""
    p = sub.add_parser("assistant", help="serve the voice banking assistant (HTTP, WebSocket, web page)")
    try:
        from g4serve_assistant.cli import add_assistant_arguments
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("g4serve_assistant"):
            raise
        p.set_defaults(func=_assistant_unavailable, assistant_missing=exc.name)
        return
    add_assistant_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="g4serve", description="Fast serving for the Gemma 4 family.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    from g4serve.deploy.ray_cli import add_ray_arguments, serve_command
    from g4serve.server.launch import add_serve_arguments

    add_serve_arguments(p)
    add_ray_arguments(p)
    p.set_defaults(func=serve_command)

    p = sub.add_parser(
        "router", help="route requests over g4serve replicas (prefix-cache-aware, session-affine)"
    )
    from g4serve.deploy.router_cli import add_router_arguments, run_router

    add_router_arguments(p)
    p.set_defaults(func=run_router)

    _add_assistant_parser(sub)

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
    _add_generate_args(p)
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # As parse_args, except that without the assistant package its subcommand takes any arguments.
    if unknown and args.func is not _assistant_unavailable:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"g4serve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
