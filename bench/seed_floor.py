"""The roofline of an offline workload: how many tokens a second a GPU could give at best.

``bench/offline_throughput.py`` submits N prompts at once and reports total tokens a second. This script
answers what the hardware allows for the same workload, with no GPU: it counts the model's parameters by
kind (the text decoder built on the meta device, so the counts are g4serve's own), replays the engine's
scheduling of the workload step by step (decodes first, then prompt chunks in arrival order up to the
token budget, ``EngineConfig``'s defaults) and charges each step the larger of

- its FLOPs at the device's peak: 2 x the active weights a token (for MoE the top-k of the experts) for
  every token, attention's QK^T and PV over the keys each query sees (sliding layers at most the window),
  and the LM head for each token that samples (a decode, a prompt's last chunk);
- its bytes at the device's bandwidth: every dense weight once, the experts the step's tokens route to
  (expected distinct experts for n tokens of top-k picks among E, uniform routing), the KV each sequence
  reads (its own layers and the KV-shared layers that read them again) and writes.

The sum is the floor of this schedule: each step as long as the slower of the two at peak, no launches, no
host time (the rows an embedding lookup gathers are left out). Another schedule has another floor:
``--max-prefill-tokens-beside-decodes`` tries the engine's cap on prompt tokens beside decodes. A measured
figure divided by the floor's tokens a second is the share of the roofline reached. Peaks are the data
sheet's dense figures (``--device``) unless given.

``--rates`` asks the same of a served load instead: for each offered rate of requests a second, the
steady state's step (``served_step``): the decodes then running and the prompt tokens that arrive in one
step, the shortest step that carries them, so the ITL floor at that rate.

    python bench/seed_floor.py --model 26b-a4b --num-requests 30 --input-len 3000 --output-len 100 \
        --device h200 --measured 31100
    python bench/seed_floor.py --model e4b --device h100 --input-len 500 --output-len 128 --rates 32 64 78
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from g4serve.bench.meta import command_line
from g4serve.config import FULL, TextConfig, preset
from g4serve.engine.config import default_token_budget

ROOT = Path(__file__).resolve().parent.parent

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) and HBM bandwidth (TB/s) from the vendors' data sheets
# (SXM parts). FP8 doubles the tensor-core peak.
DEVICES = {
    "h100": (989.0, 3.35),
    "h200": (989.0, 4.8),
    "b200": (2250.0, 8.0),
}


@dataclass(frozen=True)
class ModelCounts:
    """A text decoder's parameters by what a token reads of them."""

    dense: int  # attention, dense MLP, router, norms: read whole every step, every token multiplies them
    experts: int  # all experts of all layers (0 without MoE)
    num_experts: int
    top_k: int
    lm_head: int  # the tied embedding table, as the LM head
    gathered: int  # embedding tables a token reads one row of (the token table as an input, PLE)

    @property
    def active_per_token(self) -> float:
        """Weights one token multiplies, LM head aside."""
        share = self.top_k / self.num_experts if self.num_experts else 0.0
        return self.dense + self.experts * share

    def experts_touched(self, tokens: int) -> float:
        """Expected share of the experts that ``tokens`` tokens route to (uniform top-k, no repeats)."""
        if not self.num_experts or tokens <= 0:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** tokens


def count_parameters(cfg: TextConfig) -> ModelCounts:
    """The decoder built on the meta device (no memory), its parameters sorted by kind."""
    from g4serve.models.gemma4.text import Gemma4TextModel

    with torch.device("meta"):
        model = Gemma4TextModel(cfg)
    dense = experts = lm_head = gathered = 0
    for name, param in model.named_parameters():
        n = param.numel()
        if name == "embed_tokens.weight":
            lm_head += n
        elif name.startswith("embed_tokens_per_layer"):
            gathered += n
        elif ".experts." in name:
            experts += n
        else:
            dense += n
    return ModelCounts(
        dense=dense,
        experts=experts,
        num_experts=cfg.num_experts or 0,
        top_k=cfg.top_k_experts or 0,
        lm_head=lm_head,
        gathered=gathered,
    )


def attention_flops(cfg: TextConfig, start: int, length: int) -> float:
    """FLOPs of QK^T and PV for queries at positions ``start .. start+length-1`` over every layer (causal;
    a sliding layer's query sees at most ``sliding_window`` keys)."""
    total = 0.0
    end = start + length
    full_keys = (start + 1 + end) * length / 2  # sum of p+1 over the chunk's positions
    for layer in range(cfg.num_hidden_layers):
        heads, dim = cfg.num_attention_heads, cfg.layer_head_dim(layer)
        if cfg.layer_types[layer] == FULL:
            keys = full_keys
        else:
            w = cfg.sliding_window
            ramp_end = min(end, w)  # positions below the window see p+1 keys, the rest w
            ramp = (start + 1 + ramp_end) * (ramp_end - start) / 2 if start < ramp_end else 0.0
            keys = ramp + w * (length - max(0, ramp_end - start))
        total += 4.0 * heads * dim * keys
    return total


def kv_layer_bytes(cfg: TextConfig, kv_bytes: float) -> dict[str, tuple[float, float]]:
    """For each layer type: (cache bytes a token writes across the KV-producing layers of that type,
    cache bytes read a step per cached token across every layer of that type, shared layers included)."""
    out = {FULL: [0.0, 0.0], "sliding": [0.0, 0.0]}
    for layer in range(cfg.num_hidden_layers):
        kind = FULL if cfg.layer_types[layer] == FULL else "sliding"
        per_token = cfg.layer_num_kv_heads(layer) * cfg.layer_head_dim(layer) * kv_bytes
        per_token *= 1 if cfg.layer_uses_k_as_v(layer) else 2
        out[kind][1] += per_token
        if cfg.kv_source_layer(layer) == layer:
            out[kind][0] += per_token
    return {k: (v[0], v[1]) for k, v in out.items()}


class Chunk(NamedTuple):
    """One sequence's work in a step: ``tokens`` query tokens from position ``start`` (``count`` sequences
    alike: a served step's many decodes as one)."""

    start: int
    tokens: int
    samples: bool  # the step samples a token for it (a decode, or a prompt's last chunk)
    decode: bool
    count: int = 1


@dataclass
class _Seq:
    prompt: int
    computed: int = 0  # prompt tokens in the cache
    generated: int = 0


@dataclass(frozen=True)
class Workload:
    """N prompts submitted at once (``offline_throughput.py``) and the engine's limits on a step."""

    num_requests: int
    input_len: int
    output_len: int
    budget: int  # max_num_batched_tokens
    max_num_seqs: int
    prefill_cap: int | None = None  # max_prefill_tokens_beside_decodes

    @property
    def total_tokens(self) -> int:
        return self.num_requests * (self.input_len + self.output_len)


@dataclass(frozen=True)
class Peaks:
    """What the device does at best, and the bytes a weight and a cached K/V element take."""

    tflops: float
    tbps: float
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0


@dataclass
class Step:
    decodes: int
    prompt_tokens: int
    flops: float
    bytes: float
    seconds: float
    bound: str  # "compute" or "memory"


def schedule(w: Workload) -> list[list[Chunk]]:
    """The engine's steps for the workload (``Scheduler.schedule``): decodes (one token) first, then
    unfinished prompts in arrival order, each chunk as large as the token budget left allows (in a step
    that holds decodes, the prompt chunks together at most ``prefill_cap`` tokens), at most
    ``max_num_seqs`` sequences started. A prompt's last chunk samples its first output token."""
    seqs = [_Seq(w.input_len) for _ in range(w.num_requests)]
    steps: list[list[Chunk]] = []
    while any(s.generated < w.output_len for s in seqs):
        left = w.budget
        work: list[tuple[_Seq, Chunk]] = []
        started = [s for s in seqs if s.computed > 0 and s.generated < w.output_len]
        for s in started:
            if s.computed == s.prompt and left > 0:
                work.append((s, Chunk(s.prompt + s.generated - 1, 1, True, True)))
                left -= 1
        prefills = [s for s in started if s.computed < s.prompt]
        prefills += [s for s in seqs if s.computed == 0][: max(0, w.max_num_seqs - len(started))]
        room = left if w.prefill_cap is None or not work else min(left, w.prefill_cap)
        for s in prefills:
            if room <= 0:
                break
            n = min(room, s.prompt - s.computed)
            work.append((s, Chunk(s.computed, n, s.computed + n == s.prompt, False)))
            room -= n
        if not work:
            raise RuntimeError("no progress: the token budget or the seats are too small")
        for s, chunk in work:
            if not chunk.decode:
                s.computed += chunk.tokens
            s.generated += int(chunk.samples)
        steps.append([chunk for _, chunk in work])
    return steps


def step_cost(cfg: TextConfig, counts: ModelCounts, work: list[Chunk], peaks: Peaks) -> Step:
    """One step's floor: the larger of its FLOPs at the tensor-core peak and its bytes at the bandwidth."""
    tokens = sum(c.tokens * c.count for c in work)
    samples = sum(c.samples * c.count for c in work)
    flops = 2.0 * counts.active_per_token * tokens + 2.0 * counts.lm_head * samples
    flops += sum(attention_flops(cfg, c.start, c.tokens) * c.count for c in work)
    weights = counts.dense + counts.lm_head + counts.experts * counts.experts_touched(tokens)
    nbytes = peaks.weight_bytes * weights
    kv = kv_layer_bytes(cfg, peaks.kv_bytes)
    for c in work:
        end = c.start + c.tokens
        nbytes += (kv[FULL][0] + kv["sliding"][0]) * c.tokens * c.count  # the chunk's own K/V written
        read = kv[FULL][1] * end + kv["sliding"][1] * min(end, cfg.sliding_window + c.tokens - 1)
        nbytes += read * c.count
    compute_s, memory_s = flops / (peaks.tflops * 1e12), nbytes / (peaks.tbps * 1e12)
    decodes = sum(c.decode * c.count for c in work)
    return Step(
        decodes=decodes,
        prompt_tokens=tokens - decodes,
        flops=flops,
        bytes=nbytes,
        seconds=max(compute_s, memory_s),
        bound="compute" if compute_s >= memory_s else "memory",
    )


def workload_floor(cfg: TextConfig, counts: ModelCounts, workload: Workload, peaks: Peaks) -> dict:
    """The workload's floor: seconds, total tokens a second, and where the seconds go."""
    steps = [step_cost(cfg, counts, work, peaks) for work in schedule(workload)]
    seconds = sum(s.seconds for s in steps)
    with_prompt = [s for s in steps if s.prompt_tokens]
    decode_only = [s for s in steps if not s.prompt_tokens]
    tokens = workload.total_tokens
    return {
        "steps": len(steps),
        "floor_s": seconds,
        "total_tokens": tokens,
        "total_tokens_per_s": tokens / seconds,
        "steps_with_prompt_tokens": len(with_prompt),
        "prompt_steps_s": sum(s.seconds for s in with_prompt),
        "decode_only_steps_s": sum(s.seconds for s in decode_only),
        "compute_bound_s": sum(s.seconds for s in steps if s.bound == "compute"),
        "memory_bound_s": sum(s.seconds for s in steps if s.bound == "memory"),
        "decode_step_ms_first_last": [1e3 * decode_only[0].seconds, 1e3 * decode_only[-1].seconds]
        if decode_only
        else [],
        "decode_step_gb_first": decode_only[0].bytes / 1e9 if decode_only else 0.0,
        "prompt_steps_tflop": sum(s.flops for s in with_prompt) / 1e12,
    }


def served_step(
    cfg: TextConfig, counts: ModelCounts, peaks: Peaks, rate: float, input_len: int, output_len: int
) -> dict:
    """The steady state of a server offered ``rate`` requests a second (``input_len`` prompt tokens,
    ``output_len`` out, none cached): a step of t seconds carries the decodes of every request then decoding
    (Little's law: ``rate * output_len * t`` rows, at the middle of their outputs) and the prompt tokens
    that arrived meanwhile (``rate * input_len * t``, in whole prompts and one part). The floor's step time
    is the smallest t whose step costs no more than t (iterated from the cost of the weights alone); with
    none under a second the rate is past what the device can serve. The step time is the ITL floor at that
    rate, and ``decode_rows`` the seats it needs (``max_num_seqs``)."""
    t, cost = 0.0, None
    for _ in range(200):
        decodes = rate * output_len * t
        prompt = rate * input_len * t
        whole, part = divmod(round(prompt), input_len)
        work = [
            Chunk(input_len + output_len // 2, 1, True, True, round(decodes)),
            Chunk(0, input_len, True, False, whole),
            Chunk(0, part, False, False),
        ]
        cost = step_cost(cfg, counts, work, peaks)
        if abs(cost.seconds - t) < 1e-7 or cost.seconds > 1.0:
            break
        t = cost.seconds
    sustainable = cost.seconds <= 1.0 and abs(cost.seconds - t) < 1e-6
    return {
        "rate_per_s": rate,
        "sustainable": sustainable,
        "step_ms": 1e3 * cost.seconds,
        "decode_rows": rate * output_len * cost.seconds,
        "prompt_tokens_per_step": rate * input_len * cost.seconds,
        "output_tokens_per_s": rate * output_len if sustainable else None,
        "bound": cost.bound,
    }


def _summary(row: dict) -> str:
    share = f", measured {row['share_of_floor']:.0%} of it" if "share_of_floor" in row else ""
    first_last = row["decode_step_ms_first_last"]
    decode = f", {first_last[0]:.2f} to {first_last[1]:.2f} ms a step" if first_last else ""
    return (
        f"{row['model']} (prefill cap beside decodes {row['max_prefill_tokens_beside_decodes']}): "
        f"floor {row['floor_s']:.3f} s = {row['total_tokens_per_s'] / 1e3:.1f}k tok/s{share}; "
        f"{row['steps']} steps, {row['steps_with_prompt_tokens']} with prompt tokens "
        f"{row['prompt_steps_s']:.3f} s ({row['prompt_steps_tflop']:.0f} TFLOP), "
        f"decode-only {row['decode_only_steps_s']:.3f} s{decode}; "
        f"compute-bound {row['compute_bound_s']:.3f} s, memory-bound {row['memory_bound_s']:.3f} s"
    )


def _positive(kind):
    """An argparse type: ``kind`` of the value, refused unless finite and above zero (a rate, a length, a
    count)."""

    def parse(value: str):
        number = kind(value)
        if not (number > 0 and math.isfinite(number)):
            raise argparse.ArgumentTypeError(f"must be above 0 and finite, got {value}")
        return number

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", nargs="+", default=["26b-a4b"], help="presets (e2b, e4b, 26b-a4b, 31b, tiny)")
    p.add_argument("--num-requests", type=_positive(int), default=30)
    p.add_argument("--input-len", type=_positive(int), default=3000)
    p.add_argument("--output-len", type=_positive(int), default=100)
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive(int),
        default=None,
        help="token budget a step (default: CUDA's)",
    )
    p.add_argument("--max-num-seqs", type=_positive(int), default=64)
    p.add_argument(
        "--rates",
        type=_positive(float),
        nargs="+",
        default=None,
        help="a served load instead: requests a second, each the steady state's step (served_step)",
    )
    p.add_argument(
        "--max-prefill-tokens-beside-decodes",
        type=_positive(int),
        nargs="+",
        default=[None],
        help="the engine's cap on prompt tokens in a step with decodes; several: one floor each",
    )
    p.add_argument("--device", choices=sorted(DEVICES), default="h200", help="peaks from the data sheet")
    p.add_argument(
        "--tflops", type=_positive(float), default=None, help="tensor-core peak, overrides --device's"
    )
    p.add_argument(
        "--tbps", type=_positive(float), default=None, help="memory bandwidth TB/s, overrides --device's"
    )
    p.add_argument("--weight-bytes", type=_positive(float), default=2.0, help="bytes a weight (1: FP8)")
    p.add_argument(
        "--kv-bytes", type=_positive(float), default=2.0, help="bytes a cached K/V element (1: FP8)"
    )
    p.add_argument(
        "--measured",
        type=float,
        nargs="*",
        default=[],
        help="measured total tokens/s, one a row (model by model, cap by cap)",
    )
    p.add_argument(
        "--out-dir",
        type=lambda v: Path(v) if v else None,
        default=ROOT / "bench" / "results",
        help="where the JSON goes ('': nowhere)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tflops, tbps = DEVICES[args.device]
    tflops = args.tflops or tflops
    tbps = args.tbps or tbps
    budget = args.max_num_batched_tokens or default_token_budget("cuda")
    peaks = Peaks(tflops, tbps, args.weight_bytes, args.kv_bytes)
    rows = []
    for name in args.model:
        cfg = preset(name).text
        counts = count_parameters(cfg)
        for rate in args.rates or []:
            row = {"model": name, **served_step(cfg, counts, peaks, rate, args.input_len, args.output_len)}
            row["seats_enough"] = row["decode_rows"] <= args.max_num_seqs
            rows.append(row)
            print(
                f"{name} at {rate:g} requests/s: step (ITL floor) {row['step_ms']:.2f} ms, "
                f"{row['decode_rows']:.0f} decode rows and {row['prompt_tokens_per_step']:.0f} prompt tokens "
                f"a step, {row['bound']}-bound"
                + ("" if row["sustainable"] else "; past the device")
                + ("" if row["seats_enough"] else f"; more rows than {args.max_num_seqs} seats")
            )
        for cap in [] if args.rates else args.max_prefill_tokens_beside_decodes:
            workload = Workload(
                args.num_requests, args.input_len, args.output_len, budget, args.max_num_seqs, cap
            )
            floor = workload_floor(cfg, counts, workload, peaks)
            row = {"model": name, "max_prefill_tokens_beside_decodes": cap, "parameters": asdict(counts)}
            row.update(floor)
            if len(rows) < len(args.measured):
                row["measured_total_tokens_per_s"] = measured = args.measured[len(rows)]
                row["share_of_floor"] = measured / floor["total_tokens_per_s"]
            rows.append(row)
            print(_summary(row))
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "device_peaks": {"name": args.device, **asdict(peaks)},
        "workload": {
            "rates_per_s": args.rates,
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_batched_tokens": budget,
            "max_num_seqs": args.max_num_seqs,
        },
        "rows": rows,
    }
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        path = args.out_dir / f"seed_floor-{args.device}-{stamp}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
