"""The `transformers serve` peer: Hugging Face's own OpenAI-compatible server, serving a random-weight Gemma 4
text model of a preset's shapes, for `g4serve bench --base-url` to drive with the same workloads as g4serve.

    python3 bench/peer_serve.py --preset e4b --device cuda --port 8200 [--continuous-batching] [--compile]
    g4serve bench --workload text --base-url http://127.0.0.1:8200 --model /tmp/g4serve-peer-e4b \\
        --no-ignore-eos --extra-body '{"generation_config": "{\\"min_new_tokens\\": 100000}"}' \\
        --label transformers-serve ...

Everything that serves requests is transformers' own `transformers serve` code
(`transformers.cli.serve.Serve`: its FastAPI app, chat-completions handler, chat template, streamer, and its
sequential `generate` or continuous-batching manager), started with the flags given here. One thing differs
from `transformers serve DIR`: instead of reading a 15 GB checkpoint back from disk, its model loader hands
over the model built in memory (the same weight recipe as `bench/peer_transformers.py` and g4serve's presets:
N(0, 0.02) matrices, ones for norms), so a device run spends no minute writing and reading weights.

The tokenizer is g4serve's embedded tiny tokenizer (the one g4serve's presets serve with), padded with
`<unusedN>` special tokens to the model's vocabulary so that every id a random model can emit decodes to
text; prompts tokenize exactly as on g4serve. The model's EOS ids are the tokenizer's (`<eos>`, `<turn|>`),
as g4serve maps them for presets. The model name clients must send is the tokenizer directory (printed).

`transformers serve` rejects vLLM's `ignore_eos` (HTTP 422), so the bench sends `--no-ignore-eos` plus the
server's own `generation_config` request field with a large `min_new_tokens`, which holds every answer to
`max_tokens` on the sequential path; on the continuous-batching path a `generation_config` without EOS ids
disables EOS (transformers sets it to -1). It ignores `response_format` (no constrained decoding) and drops
`{"type": "video"}` message parts, so only text workloads are comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIN_NEW_TOKENS_BODY = json.dumps({"generation_config": json.dumps({"min_new_tokens": 100_000})})


def write_peer_tokenizer(out_dir: Path, vocab_size: int) -> Path:
    """g4serve's embedded tiny tokenizer with ``<unusedN>`` specials up to ``vocab_size`` tokens."""
    from tokenizers import AddedToken

    from g4serve.processing.tiny_tokenizer import build_tiny_tokenizer, gemma4_chat_template, tokenizer_config

    tok = build_tiny_tokenizer()
    base = tok.get_vocab_size()
    if vocab_size > base:
        start = 1 + max(int(t[len("<unused") : -1]) for t in tok.get_vocab() if t.startswith("<unused"))
        tok.add_special_tokens(
            [
                AddedToken(f"<unused{start + i}>", special=True, normalized=False)
                for i in range(vocab_size - base)
            ]
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(gemma4_chat_template())
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="e4b", help="g4serve preset whose text shapes to build (default e4b)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument(
        "--tokenizer-dir",
        default=None,
        help="where to write the tokenizer; also the model name clients send "
        "(default /tmp/g4serve-peer-PRESET)",
    )
    p.add_argument(
        "--continuous-batching", action="store_true", help="transformers serve --continuous-batching"
    )
    p.add_argument(
        "--compile", action="store_true", help="transformers serve --compile (static cache + torch.compile)"
    )
    p.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers serve --attn-implementation (default: "
        "sdpa, or the server's choice with --continuous-batching)",
    )
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: the model is local

    import torch
    import transformers
    from peer_transformers import build  # bench/, on the path above
    from transformers.cli.serving import model_manager

    from g4serve.processing.tiny_tokenizer import SPECIAL_TOKENS

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model, _ = build(args.preset, device, getattr(torch, args.dtype), args.seed)
    if args.attn_implementation:
        model.set_attn_implementation(args.attn_implementation)
    # g4serve serves presets with its tiny tokenizer and maps EOS to its <eos> and <turn|>
    # (loader.adopt_tokenizer_special_ids).
    eos = [SPECIAL_TOKENS.index("<eos>"), SPECIAL_TOKENS.index("<turn|>")]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = SPECIAL_TOKENS.index("<bos>")
    model.generation_config.pad_token_id = SPECIAL_TOKENS.index("<pad>")
    build_s = time.perf_counter() - t0
    tok_dir = write_peer_tokenizer(
        Path(args.tokenizer_dir or f"/tmp/g4serve-peer-{args.preset}"), model.config.vocab_size
    )

    def load_built_model(self, *a, **k):  # transformers serve's loader, handing over the model built above
        return model

    model_manager.ModelManager._load_model = load_built_model
    from transformers.cli.serve import Serve

    info = {
        "peer": "transformers serve",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "preset": args.preset,
        "device": device,
        "dtype": args.dtype,
        "build_s": round(build_s, 1),
        "model_name": str(tok_dir),
        "continuous_batching": args.continuous_batching,
        "compile": args.compile,
        "attn_implementation": model.config._attn_implementation,
        "port": args.port,
    }
    print("[peer_serve] " + json.dumps(info), flush=True)
    Serve(
        force_model=str(tok_dir),
        continuous_batching=args.continuous_batching,
        compile=args.compile,
        attn_implementation=args.attn_implementation,
        device=device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
