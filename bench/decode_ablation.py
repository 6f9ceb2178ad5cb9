"""What a decode step would cost without some of its small kernels: upper bounds for fusion work.

Runs ``bench/engine_microbench.py`` after replacing chosen pieces of the Gemma 4 layer with no-ops, so
the CUDA graphs it captures simply lack those launches. **The tokens it generates are garbage**; only
the step times mean anything. A piece that takes 0.2 ms off here can take at most 0.2 ms off when it is
fused into a neighbour, and a fusion that cannot beat its ablation is not worth writing.

Pieces (``--ablate``, comma-separated):
  norms      every residual-add RMSNorm pass of a layer (three a layer with PLE): h and x pass through
  prep       the attention prologue (q/k/v norms, RoPE, K/V cache write): q is the raw projection
  reduce     the split-KV merge of decode attention (its output is left unwritten)
  attention  the whole attention call (prologue aside): its output is q

  python bench/decode_ablation.py --ablate norms,prep -- --model e4b --device cuda \\
      --attention-backend triton --batches 1,8 --decode-steps 16 --prefill-lengths 512 \\
      --tag=-ablate-norms-prep
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


class _NoKernel:
    """Stands in for ``DualKernel``: ``kernel[device][grid](*args)`` launches nothing."""

    def __getitem__(self, _key):
        return self

    def __call__(self, *args, **kwargs):
        return None


def _no_norms() -> None:
    from g4serve.models.gemma4 import text

    def passthrough(x, norm, residual=None, scale=None, next_norm=None):
        return x, (x if next_norm is not None else None)

    text.add_rms_norm = passthrough


def _no_prep() -> None:
    from g4serve.models.gemma4 import text

    def raw_q(qkv, num_heads, num_kv_heads, q_norm, k_norm, cos, sin, target, v_is_k=False):
        head_dim = qkv.shape[-1] // (num_heads + num_kv_heads * (1 if v_is_k else 2))
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)

    text.qkv_norm_rope_write = raw_q
    text.norm_rope = lambda x, norm, cos=None, sin=None, sections=1: x


def _no_reduce() -> None:
    from g4serve.kernels import paged_decode

    paged_decode._paged_decode_reduce = _NoKernel()


def _no_attention() -> None:
    from g4serve.layers.attention import TritonAttention

    TritonAttention.attend = lambda self, layer_idx, q, k, v, meta: q


ABLATIONS = {"norms": _no_norms, "prep": _no_prep, "reduce": _no_reduce, "attention": _no_attention}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ablate", default="", help="comma-separated: " + ", ".join(ABLATIONS))
    args = p.parse_args(argv[:split])
    for name in filter(None, args.ablate.split(",")):
        if name not in ABLATIONS:
            p.error(f"--ablate: unknown piece {name!r} (choose from {', '.join(ABLATIONS)})")
        ABLATIONS[name]()
    sys.argv = [str(HERE / "engine_microbench.py"), *argv[split + 1 :]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
