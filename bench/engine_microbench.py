"""Engine microbenchmarks: decode step time per batch size, prefill (TTFT) per prompt length, and the
memory-bandwidth floor of a decode step.

    python bench/engine_microbench.py --model e4b --device cuda --out bench/results
    python bench/engine_microbench.py --model e4b --device cuda --quantization fp8   # fp8-block, w4a16, ...
    python bench/engine_microbench.py --model e4b --attention-backend triton --kv-cache-dtype fp8
    python bench/engine_microbench.py                       # tiny model on CPU (engine overhead only)

Decode: B requests are prefilled, then `--decode-steps` engine steps (each one token for all B)
are timed; ITL = step time. Prefill: one request of L prompt tokens and max_tokens=1, timed
from submission to its first token (TTFT), after a warm-up of the same length. Floor: bytes a
decode step must read (every weight used per token, once, plus the KV cache) ÷ measured copy
bandwidth (with ``--quantization``, the quantized weights' own bytes: FP8 values, packed int4, scales and
zero points). Writes one JSON with the device, versions, command and every figure with its unit.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch

from g4serve import envs
from g4serve.bench.meta import command_line, git_commit, write_result_json
from g4serve.engine.config import KV_CACHE_DTYPES
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.quant_config import QUANTIZATION_PRESETS
from g4serve.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth from a large copy (read + write bytes / time)."""
    if device.type != "cuda":
        nbytes = 1 << 27
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    reps = 20 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0) / 1e9


def decode_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads: every text-decoder parameter except the embedding tables
    (one row each per token), with the tied LM head (the whole token table) counted once."""
    lm = engine.model.language_model
    total = 0
    for name, p in lm.named_parameters():
        if name.startswith("embed_tokens_per_layer"):
            continue  # one gathered row per token
        if name == "embed_tokens.weight":
            continue  # counted below as the LM head
        total += p.numel() * p.element_size()
    total += lm.embed_tokens.weight.numel() * lm.embed_tokens.weight.element_size()
    cfg = engine.model_config.text
    if cfg.enable_moe_block:  # only top_k of the experts are read per token (batch 1)
        per_expert = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if ".experts." in n)
        total -= per_expert * (1 - cfg.top_k_experts / cfg.num_experts)
    return int(total)


def prompt_ids(engine: LLMEngine, length: int, salt: int) -> dict:
    vocab = min(engine.tokenizer.vocab_size, engine.model_config.text.vocab_size)
    g = torch.Generator().manual_seed(salt)
    ids = torch.randint(1000 if vocab > 4000 else 20, vocab, (length,), generator=g).tolist()
    return {"prompt_token_ids": [engine.tokenizer.bos_token_id or 2, *ids[1:]]}


def start_decoding(
    engine: LLMEngine,
    batch: int,
    prompt_len: int,
    params: SamplingParams,
    prefix: str,
    adapters: list[str | None] | None = None,
    salt: int = 0,
    warm_steps: int = 1,
) -> None:
    """Add ``batch`` requests of ``prompt_len`` tokens (ids ``prefix-i``; ``adapters`` in turn), prefill them
    all and run ``warm_steps`` more steps, so that every request is in steady decode."""
    adapters = adapters or [None]
    for i in range(batch):
        prompt = engine.process_prompt(prompt_ids(engine, prompt_len, salt + i))
        lora = adapters[i % len(adapters)]
        engine.add_request(engine.make_request(f"{prefix}-{i}", prompt, params, lora_name=lora))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    _sync(engine.device)
    decoding = sum(rid.startswith(f"{prefix}-") for rid in engine.requests)
    if decoding < batch:  # a timing from here on would be of fewer rows than it says
        raise RuntimeError(
            f"{batch - decoding} of {batch} requests ended before the timed steps (max_tokens "
            f"{params.max_tokens}; size it with decode_max_tokens)"
        )


def decode_max_tokens(
    engine: LLMEngine, batch: int, prompt_len: int, steps: int, tokens_per_step: int = 1
) -> int:
    """``max_tokens`` for ``start_decoding``'s requests that then decode ``steps`` timed steps: the requests
    whose prompts finish first decode during the others' prefill steps (a token budget of prompt tokens each,
    one more step per request where a prompt ends mid-budget), and must not end before the timing does."""
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens) + batch
    return tokens_per_step * (steps + 8 + prefill_steps)


def timed_steps(engine: LLMEngine, steps: int) -> tuple[list[float], float]:
    """Run ``steps`` engine steps: (seconds each ``step()`` took, seconds for all of them until the device
    is idle). No device sync per step: a step() returns once it has read back a step's tokens, and a sync
    would also wait for the step async scheduling has launched ahead (the overlap being measured)."""
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    _sync(engine.device)
    return times, time.perf_counter() - start


def bench_decode(
    engine: LLMEngine,
    batch: int,
    prompt_len: int,
    steps: int,
    sampling: dict | None = None,
    adapters: list[str | None] | None = None,
) -> dict:
    """Decode ITL at ``batch``; ``sampling``: SamplingParams fields of the requests (default greedy);
    ``adapters``: LoRA adapter names given to the requests in turn (None: the base model)."""
    max_tokens = decode_max_tokens(engine, batch, prompt_len, steps)
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=max_tokens, ignore_eos=True)
    start_decoding(engine, batch, prompt_len, params, f"d{batch}", adapters)
    times, total = timed_steps(engine, steps)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "steps": steps,
        "itl_mean_ms": 1e3 * total / steps,
        "itl_p50_ms": 1e3 * statistics.median(times),
        "itl_min_ms": 1e3 * min(times),
        "output_tokens_per_s": batch / statistics.median(times),
    }


def bench_prefill(engine: LLMEngine, length: int, reps: int, lora: str | None = None, salt: int = 0) -> dict:
    """TTFT of fresh ``length``-token prompts (``salt`` keeps the prompts of several calls apart: no
    prefix-cache hits); ``lora``: the requests' adapter."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for rep in range(reps + 1):  # the first is warm-up
        prompt = engine.process_prompt(prompt_ids(engine, length, 10_000 + 1000 * salt + rep))
        request = engine.make_request(f"p{length}-{rep}-{salt}", prompt, params, lora_name=lora)
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.add_request(request)
        engine.run_until_finished()
        _sync(engine.device)
        if rep:
            ttfts.append(time.perf_counter() - t0)
    return {
        "prompt_tokens": length,
        "reps": reps,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_min_ms": 1e3 * min(ttfts),
    }


def profile_decode(engine: LLMEngine, prompt_len: int, batch: int = 1, steps: int = 8) -> dict:
    """Where a decode step's time goes: device time summed over kernels vs the step's wall time."""
    params = SamplingParams(
        temperature=0, max_tokens=decode_max_tokens(engine, batch, prompt_len, steps), ignore_eos=True
    )
    start_decoding(engine, batch, prompt_len, params, "prof", salt=99)

    def run() -> None:
        for _ in range(steps):
            engine.step()

    out = _profiled(engine, run, steps, f"batch {batch}")
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return out


def profile_prefill(engine: LLMEngine, length: int, reps: int = 3) -> dict:
    """Where a prefill's time goes: ``reps`` fresh ``length``-token prompts (one warm-up before), each run to
    its first token; per prompt: device time summed over kernels vs wall time."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [engine.process_prompt(prompt_ids(engine, length, 50_000 + rep)) for rep in range(reps + 1)]
    engine.add_request(engine.make_request("prof-prefill-warm", prompts[0], params))
    engine.run_until_finished()
    _sync(engine.device)

    def run() -> None:
        for rep, prompt in enumerate(prompts[1:]):
            engine.add_request(engine.make_request(f"prof-prefill-{rep}", prompt, params))
            engine.run_until_finished()

    return _profiled(engine, run, reps, f"prefill {length}")


def _profiled(engine: LLMEngine, run: Callable[[], None], units: int, label: str) -> dict:
    """torch.profiler over ``run()``: per unit (a step, a prompt), wall and device time, device ops, and the
    kernel table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        _sync(engine.device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / units
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / units
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / units
    table = events.table(sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total", row_limit=40)
    summary = {
        "units": units,
        "wall_ms_per_step": wall_ms,
        "device_ms_per_step": device_us / 1e3,
        "device_ops_per_step": kernels,
    }
    print(
        f"profile ({label}): {wall_ms:.2f} ms wall each, {device_us / 1e3:.2f} ms of device time, "
        f"{kernels:.0f} device ops",
        flush=True,
    )
    return {"summary": summary, "table": table}


def host_profile_decode(engine: LLMEngine, batch: int, prompt_len: int, steps: int = 16) -> str:
    """cProfile of ``steps`` decode steps at ``batch``: where the host's share of a step goes."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(
        temperature=0, max_tokens=decode_max_tokens(engine, batch, prompt_len, steps), ignore_eos=True
    )
    start_decoding(engine, batch, prompt_len, params, "h", salt=500)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    return f"batch {batch}, {steps} decode steps\n" + text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="preset (e4b, ...) or checkpoint dir; default: embedded tiny model"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATION_PRESETS),
        help="quantize the preset's weights at load (EngineConfig.quantization); a compressed-tensors "
        "checkpoint given as --model is measured as quantized without it",
    )
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--decode-prompt-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prefill-lengths", default="128,512,2048")
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV-cache storage (EngineConfig.kv_cache_dtype): fp8 stores e4m3, one byte a value",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: the engine's choice (Triton kernels on CUDA, the PyTorch reference elsewhere)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch each step before reading the previous one back (EngineConfig.async_scheduling; "
        "default: on)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="decode requests sample at this temperature (default 0: greedy, the argmax in the graph)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="decode requests' top_p (with --temperature)")
    p.add_argument("--top-k", type=int, default=0, help="decode requests' top_k (with --temperature)")
    p.add_argument("--seed", type=int, default=None, help="decode requests' seed (with --temperature)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile 8 decode steps at batch 1 (torch.profiler): kernel table next to the JSON",
    )
    p.add_argument(
        "--profile-batches",
        default=None,
        help="comma-separated batch sizes to profile (implies --profile; default 1)",
    )
    p.add_argument(
        "--profile-prefill",
        default=None,
        help="comma-separated prompt lengths whose prefill to profile (torch.profiler, 3 prompts each): "
        "kernel tables next to the JSON",
    )
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="also run cProfile over decode steps at the largest batch: host-side hot spots next to the JSON",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks the decoder splits over (one GPU each)"
    )
    p.add_argument("--enable-expert-parallel", action="store_true", help="with it: whole experts per rank")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",") if b]
    lengths = [int(x) for x in args.prefill_lengths.split(",") if x]
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        text_only=True,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(args.max_num_batched_tokens, *lengths),
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t0
    device = engine.device
    print(
        f"loaded {args.model or 'tiny'} on {device} in {load_s:.1f}s; KV {engine.kv.capacity_tokens()}",
        flush=True,
    )

    bandwidth = copy_bandwidth_gbps(device)
    weight_bytes = decode_weight_bytes(engine)
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s; decode reads {weight_bytes / 1e9:.2f} GB of weights "
        f"-> floor {floor_ms:.2f} ms/step at batch 1",
        flush=True,
    )

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    decode = []
    for b in batches:
        row = bench_decode(engine, b, args.decode_prompt_tokens, args.decode_steps, sampling)
        decode.append(row)
        print(
            f"decode batch {b:3d}: ITL p50 {row['itl_p50_ms']:.2f} ms, "
            f"{row['output_tokens_per_s']:.0f} tok/s",
            flush=True,
        )
    graphed = engine.runner.num_graph_steps > 0
    prefill = []
    for length in lengths:
        row = bench_prefill(engine, length, args.prefill_reps)
        prefill.append(row)
        print(f"prefill {length:5d} tokens: TTFT p50 {row['ttft_p50_ms']:.2f} ms", flush=True)
    # Last: CUPTI stays attached after a profile and slows later launches.
    profile_batches = [
        int(b) for b in (args.profile_batches or ("1" if args.profile else "")).split(",") if b
    ]
    profiles = {b: profile_decode(engine, args.decode_prompt_tokens, b) for b in profile_batches}
    prefill_profiles = {
        n: profile_prefill(engine, n) for n in (int(x) for x in (args.profile_prefill or "").split(",") if x)
    }
    host_profile = (
        host_profile_decode(engine, max(batches), args.decode_prompt_tokens) if args.cprofile else None
    )

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    result = {
        "benchmark": "engine_microbench",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": command_line(),
        "switches": envs.recorded(),  # the G4SERVE_* kernel switches of this run
        "device": name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": args.model or "tiny (embedded)",
        "dtype": str(engine.dtype),
        "quantization": (
            engine.model_config.quantization.describe() if engine.model_config.quantization else None
        ),
        "quantization_preset": args.quantization,
        "attention_backend": type(engine.runner.backend).__name__,
        "kv_cache_dtype": str(next(iter(engine.kv_cache.kv.values())).dtype),
        "kv_capacity_tokens": engine.kv.capacity_tokens(),
        "cuda_graphs": graphed,
        "async_scheduling": engine.config.async_scheduling,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "expert_parallel": engine.config.enable_expert_parallel,
        "decode_sampling": sampling,
        "load_s": load_s,
        "copy_bandwidth_gb_per_s": bandwidth,
        "decode_weight_bytes": weight_bytes,
        "decode_floor_batch1_ms": floor_ms,
        "decode": decode,
        "prefill": prefill,
    }
    for b, prof in profiles.items():
        result[f"profile_batch{b}"] = prof["summary"]
    for n, prof in prefill_profiles.items():
        result[f"profile_prefill{n}"] = prof["summary"]
    path = write_result_json(
        args.out,
        f"microbench-{(args.model or 'tiny').replace('/', '_')}-{device.type}"
        f"{'-' + args.quantization if args.quantization else ''}{args.tag}",
        result,
    )
    for b, prof in profiles.items():
        path.with_suffix(".profile.txt" if b == 1 else f".profile-b{b}.txt").write_text(prof["table"])
    for n, prof in prefill_profiles.items():
        path.with_suffix(f".profile-prefill{n}.txt").write_text(prof["table"])
    if host_profile is not None:
        path.with_suffix(".cprofile.txt").write_text(host_profile)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
