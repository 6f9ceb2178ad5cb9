"""Decode speed of one model in several serving formats side by side: bf16, quantized weights, the FP8 KV
cache, and MTP speculative decoding at forced acceptance rates, each against its bandwidth floor.

    python bench/spec_decode.py --model e4b --device cuda \\
        --variants bf16,mtp@1.0,mtp@0.7,fp8,w4a16,fp8kv --batches 1,8,32,64 --out bench/results

A variant joins parts with ``+``: a ``--quantization`` preset (``fp8``, ``fp8-block``, ``w4a16``, ...),
``fp8kv`` (``--kv-cache-dtype fp8``) and ``mtp@R`` (the MTP drafter, ``--num-spec`` drafts a round, forced
acceptance R; random weights accept nothing on their own). ``bf16`` alone is the plain engine. Every engine
uses the Triton backend, CUDA graphs and async scheduling, as served.

Decode: B requests of ``--prompt-len`` tokens are prefilled and run one step into decode; then
``--steps`` engine steps are timed and the output tokens they produced counted: tokens/s = tokens / time,
ITL = B / tokens/s (the time per token of one request; with MTP a step yields up to 1 + k of them).
TTFT: one fresh ``--prefill-len`` prompt (not for MTP variants: their prefill is the plain one). Floor: the
bytes a decode step must read (``engine_microbench.decode_weight_bytes``: the format's own weight bytes,
plus the drafter's ``k`` rounds for MTP) ÷ copy bandwidth; per token at forced acceptance 1.0 it is that
÷ (1 + k). Writes one JSON (device, versions, command, every figure with its unit) and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_microbench import (  # noqa: E402
    bench_prefill,
    copy_bandwidth_gbps,
    decode_max_tokens,
    decode_weight_bytes,
    start_decoding,
    timed_steps,
)
from trace_summary import kernel_chain  # noqa: E402

from g4serve import envs  # noqa: E402
from g4serve.bench.meta import command_line, git_commit, write_result_json  # noqa: E402
from g4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from g4serve.quant_config import QUANTIZATION_PRESETS  # noqa: E402
from g4serve.sampling_params import SamplingParams  # noqa: E402


def parse_variant(name: str, num_spec: int) -> dict:
    """EngineConfig fields of variant ``name`` (see the module docstring)."""
    fields: dict = {}
    for part in name.split("+"):
        if part == "bf16":
            continue
        if part == "fp8kv":
            fields["kv_cache_dtype"] = "fp8"
        elif part in QUANTIZATION_PRESETS:
            fields["quantization"] = part
        elif part.startswith("mtp@"):
            rate = float(part[4:])
            fields["speculative_config"] = {
                "method": "mtp",
                "model": "random",
                "num_speculative_tokens": num_spec,
                "forced_acceptance": rate,
            }
        else:
            raise SystemExit(f"--variants: unknown part {part!r} in {name!r}")
    return fields


def bench_tokens(engine: LLMEngine, batch: int, prompt_len: int, steps: int, salt: int) -> dict:
    """Output tokens/s of ``batch`` greedy requests over ``steps`` decode steps (see the module docstring)."""
    k = engine.speculative.num_speculative_tokens if engine.speculative else 0
    max_tokens = decode_max_tokens(engine, batch, prompt_len, steps, 1 + k)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # two steps after the prefill: drafts proposed, every request is in steady (speculative) decode
    start_decoding(engine, batch, prompt_len, params, f"s{salt}-{batch}", salt=1000 * salt, warm_steps=2)
    before = engine.num_generated_tokens
    drafted, accepted = sum(engine.spec_stats.drafted), sum(engine.spec_stats.accepted)
    times, total = timed_steps(engine, steps)
    tokens = engine.num_generated_tokens - before
    for rid in list(engine.requests):
        engine.abort_request(rid)
    rounds = sum(engine.spec_stats.drafted) - drafted
    return {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "steps": steps,
        "output_tokens": tokens,
        "step_p50_ms": 1e3 * statistics.median(times),
        "output_tokens_per_s": tokens / total,
        "itl_ms": 1e3 * total * batch / tokens,
        "accepted_per_draft": (sum(engine.spec_stats.accepted) - accepted) / rounds if rounds else None,
    }


def profile_steps(
    engine: LLMEngine, batch: int, prompt_len: int, steps: int, out_dir: Path, tag: str
) -> dict:
    """``steps`` decode steps of ``batch`` requests under torch.profiler: wall time per step against the
    device's kernel time per step (the gap is the GPU waiting for the host), the kernels that take the most
    time (their own durations, which under dependent launch include the wait for the kernel before), what
    each adds to the stream's timeline (``chain_kernels``: ``trace_summary.kernel_chain``, the shares that
    sum to the step), and a Chrome trace beside the JSON."""
    from torch.profiler import ProfilerActivity, profile

    k = engine.speculative.num_speculative_tokens if engine.speculative else 0
    max_tokens = decode_max_tokens(engine, batch, prompt_len, steps, 1 + k)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start_decoding(engine, batch, prompt_len, params, f"prof-{batch}", salt=99_000, warm_steps=3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, wall = timed_steps(engine, steps)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    device_us = sum(e.self_device_time_total for e in kernels)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"trace-{tag.replace('@', '-at-').replace('+', '-')}-b{batch}.json"
    prof.export_chrome_trace(str(trace))
    chain = kernel_chain(json.loads(trace.read_text()))
    return {
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "device_kernel_ms_per_step": device_us / 1e3 / steps,
        "top_kernels": [
            {
                "name": e.key[:120],
                "calls_per_step": e.count / steps,
                "ms_per_step": e.self_device_time_total / 1e3 / steps,
            }
            for e in kernels[:15]
        ],
        "chain_kernels": [
            {
                "name": name[:120],
                "calls_per_step": row["launches"] / steps,
                "chain_ms_per_step": row["chain_us"] / 1e3 / steps,
                "own_ms_per_step": row["own_us"] / 1e3 / steps,
            }
            for name, row in list(chain.items())[:15]
        ],
        "trace": trace.name,
    }


def drafter_bytes(engine: LLMEngine) -> int:
    """Bytes one MTP drafter step reads: its weights but the LM-head table, of which ordered embeddings read
    the centroid clusters' rows only."""
    drafter = engine.proposer.drafter
    total = sum(
        p.numel() * p.element_size() for n, p in drafter.named_parameters() if n != "embed_tokens.weight"
    )
    head = drafter.embed_tokens.weight
    rows = head.shape[0]
    if drafter.masked_embedding is not None:
        m = drafter.masked_embedding
        rows = m.top_k * m.per_centroid
    return int(total + rows * head.shape[1] * head.element_size())


def kv_fit(engine: LLMEngine, seqs: int, length: int) -> dict:
    """Whether the KV pools hold ``seqs`` sequences of ``length`` tokens each at once, by the block manager's
    own accounting: what one sequence decoding its next token at that length needs in every pool (the
    sliding pool only its window), times ``seqs``, against each pool's blocks."""
    kv = engine.kv
    per_seq = kv.blocks_needed("kv-fit-probe", length - 1, 1)
    pools = {
        pool: {"blocks_needed": seqs * need, "blocks": kv.pools[pool].num_blocks}
        for pool, need in per_seq.items()
    }
    return {
        "sequences": seqs,
        "tokens_each": length,
        "pools": pools,
        "fits": all(p["blocks_needed"] <= p["blocks"] for p in pools.values()),
    }


def run_variant(args, name: str, bandwidth: float | None) -> tuple[dict, float]:
    fields = parse_variant(name, args.num_spec)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        text_only=True,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, args.prefill_len),
        kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        attention_backend="triton" if args.device != "cpu" else "torch",
        **fields,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t0
    if bandwidth is None:
        bandwidth = copy_bandwidth_gbps(engine.device)
    weight_bytes = decode_weight_bytes(engine)
    k = engine.speculative.num_speculative_tokens if engine.speculative else 0
    step_bytes = weight_bytes + (k * drafter_bytes(engine) if k else 0)
    floor_ms = step_bytes / (bandwidth * 1e9) * 1e3
    print(
        f"[{name}] loaded in {load_s:.0f}s; KV {engine.kv.capacity_tokens()}; floor {floor_ms:.2f} ms",
        flush=True,
    )
    fit = kv_fit(engine, *args.fit) if args.fit else None
    if fit is not None:
        print(
            f"[{name}] KV for {args.fit[0]} x {args.fit[1]} tokens: fits={fit['fits']} {fit['pools']}",
            flush=True,
        )
    decode = []
    for salt, batch in enumerate(args.batches):
        row = bench_tokens(engine, batch, args.prompt_len, args.steps, salt)
        decode.append(row)
        print(
            f"[{name}] B={batch:3d}: ITL {row['itl_ms']:.2f} ms/token, "
            f"{row['output_tokens_per_s']:.0f} tok/s, step {row['step_p50_ms']:.2f} ms",
            flush=True,
        )
    profiled = None
    if args.profile:
        profiled = profile_steps(engine, args.batches[0], args.prompt_len, args.profile, Path(args.out), name)
        print(
            f"[{name}] profile B={profiled['batch']}: {profiled['wall_ms_per_step']:.2f} ms/step wall, "
            f"{profiled['device_kernel_ms_per_step']:.2f} ms/step of kernels",
            flush=True,
        )
        print("    on the stream's timeline (chain ms, own ms, launches a step):", flush=True)
        for kernel in profiled["chain_kernels"][:10]:
            print(
                f"    {kernel['chain_ms_per_step']:7.3f} {kernel['own_ms_per_step']:7.3f} ms "
                f"x{kernel['calls_per_step']:5.1f}  {kernel['name']}",
                flush=True,
            )
    ttft = None
    if not k and args.prefill_len:
        ttft = bench_prefill(engine, args.prefill_len, args.prefill_reps)
        print(f"[{name}] TTFT {args.prefill_len}: {ttft['ttft_p50_ms']:.1f} ms", flush=True)
    result = {
        "variant": name,
        "engine_fields": fields,
        "load_s": load_s,
        "kv_cache_dtype": str(next(iter(engine.kv_cache.kv.values())).dtype),
        "kv_capacity_tokens": engine.kv.capacity_tokens(),
        "kv_fit": fit,
        "gpu_memory_allocated_gib": (
            torch.cuda.memory_allocated(engine.device) / 2**30 if engine.device.type == "cuda" else None
        ),
        "weight_bytes": weight_bytes,
        "step_bytes": step_bytes,
        "floor_step_ms": floor_ms,
        "floor_token_ms_b1": floor_ms / (1 + k),
        "num_speculative_tokens": k,
        "graph_steps": engine.runner.num_graph_steps,
        "draft_graph_rounds": getattr(engine.proposer, "num_graph_rounds", None),
        "decode": decode,
        "profile": profiled,
        "ttft": ttft,
    }
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, bandwidth


def _table(leads: list[str], rows: list[tuple[list[str], dict]], batches: list[int]) -> str:
    """Markdown: the ``leads`` columns, the floor, ITL (tokens/s) per batch size (blank where a row did not
    time it) and TTFT; a row per (lead cells, variant result)."""
    head = " | ".join(f"B={b} ITL (tok/s)" for b in batches)
    lines = [
        f"| {' | '.join(leads)} | floor ms/token (B=1) | {head} | TTFT |",
        "|---" * (len(leads) + 2 + len(batches)) + "|",
    ]
    for lead, v in rows:
        by_batch = {d["batch"]: d for d in v["decode"]}
        cells = " | ".join(
            f"{by_batch[b]['itl_ms']:.2f} ({by_batch[b]['output_tokens_per_s']:.0f})" if b in by_batch else ""
            for b in batches
        )
        ttft = f"{v['ttft']['ttft_p50_ms']:.1f} ms" if v["ttft"] else "="
        lines.append(f"| {' | '.join(lead)} | {v['floor_token_ms_b1']:.2f} | {cells} | {ttft} |")
    return "\n".join(lines)


def table(results: list[dict], batches: list[int]) -> str:
    return _table(["variant"], [([r["variant"]], r) for r in results], batches)


def merged_table(docs: list[dict]) -> str:
    """One table of several runs' variants (one model each, e.g. one run per model in a device call): a row
    per (model, variant), a column per batch size any run timed (blank where a run did not)."""
    batches = sorted({d["batch"] for doc in docs for v in doc["variants"] for d in v["decode"]})
    rows = [([Path(doc["model"]).name, v["variant"]], v) for doc in docs for v in doc["variants"]]
    return _table(["model", "variant"], rows, batches)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="print one table of these runs' JSON (also to --out as formats-table-*.md); runs nothing",
    )
    p.add_argument("--model", default="e4b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="bf16,mtp@1.0,mtp@0.7")
    p.add_argument("--num-spec", type=int, default=3, help="drafts per MTP round (k)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=2048, help="TTFT prompt length (0: none)")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument(
        "--fit",
        type=lambda s: tuple(int(x) for x in s.lower().split("x")),
        default=None,
        metavar="SEQSxTOKENS",
        help="report whether the KV cache holds SEQS sequences of TOKENS tokens at once (e.g. 32x8192)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile STEPS decode steps at the first batch size (device kernel time against wall time)",
    )
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.merge:
        text = merged_table([json.loads(Path(f).read_text()) for f in args.merge])
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (
            out / f"formats-table{args.tag}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}.md"
        ).write_text(text + "\n")
        return 0

    results, bandwidth = [], None
    for name in args.variants.split(","):
        result, bandwidth = run_variant(args, name, bandwidth)
        results.append(result)
    device = torch.device(args.device)
    out = {
        "benchmark": "spec_decode",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": command_line(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "switches": envs.recorded(),
        "model": args.model,
        "copy_bandwidth_gb_per_s": bandwidth,
        "units": "itl_ms: ms per output token of one request; output_tokens_per_s: all requests; floor: ms",
        "variants": results,
    }
    text = table(results, args.batches)
    print(text)
    path = write_result_json(args.out, f"spec-decode-{Path(args.model).name}{args.tag}", out)
    path.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
