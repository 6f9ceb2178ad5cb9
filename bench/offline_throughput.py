"""Offline throughput and latency of the g4serve engine: N requests submitted at once, stepped to the end.

Runs on the embedded tiny model by default (CPU-friendly; ``--model`` takes a checkpoint directory or a
preset, ``--device cuda`` a GPU). Prompts are random token ids of random lengths; with ``--mix`` some
requests also carry a random image, audio clip or video. Every request ignores EOS and generates exactly
``--output-len`` tokens. Prints a summary and writes a JSON (environment, exact command, parameters and
every figure with its unit in its key) to ``bench/results/``. ``--compare-reference`` runs the same prompts
one at a time through the unbatched reference loop to show what continuous batching buys.

    python bench/offline_throughput.py --num-requests 64 --input-len 32 256 --output-len 32
    python bench/offline_throughput.py --mix text,image,audio --compare-reference
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Self

import numpy as np
import torch

from g4serve import envs
from g4serve.bench.meta import command_line
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.outputs import RequestOutput
from g4serve.processing.processor import ProcessedPrompt
from g4serve.reference import generate_one
from g4serve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
MODALITIES = ("text", "image", "audio", "video")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or preset (tiny, e2b, e4b, 26b-a4b, 31b); "
        "default: the embedded tiny model",
    )
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, auto")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument(
        "--quantization", default=None, help="EngineConfig.quantization: fp8, fp8-block, w4a16, w4a16-g32"
    )
    g.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[32, 256],
        metavar=("MIN", "MAX"),
        help="text prompt length range in tokens (uniform, inclusive); media tokens come on top",
    )
    g.add_argument("--output-len", type=int, default=32, help="tokens generated per request (EOS ignored)")
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens every prompt starts with (exercises the prefix cache); part of --input-len",
    )
    g.add_argument(
        "--mix",
        default="text",
        help="comma-separated modalities assigned round-robin: text, image, "
        "audio, video (e.g. text,image,audio: a third of the requests each)",
    )
    g.add_argument("--image-size", default="256x256", help="WxH of the random images")
    g.add_argument("--audio-seconds", type=float, default=2.0)
    g.add_argument("--video-frames", type=int, default=4)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--warmup-requests", type=int, default=4, help="short requests run (and not counted) first"
    )
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (default: the engine's, 8192 on CUDA and 2048 on CPU)",
    )
    g.add_argument(
        "--max-prefill-tokens-beside-decodes",
        type=int,
        default=None,
        help="prompt tokens a step that holds decodes may carry (default: the whole budget)",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV budget (default: the engine's: 256 MiB on CPU, gpu_memory_utilization on CUDA)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-fast-prefill", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument(
        "--attention-backend",
        default=None,
        help="EngineConfig.attention_backend, where the engine has it (default: the engine's choice)",
    )
    g.add_argument(
        "--load-towers",
        action="store_true",
        help="load the vision/audio towers for a text-only mix too (default: text-only mode)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--compare-reference",
        action="store_true",
        help="also run every prompt alone through g4serve.reference.generate_one",
    )
    g.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    g.add_argument("--tag", default=None, help="suffix of the result file name (default: the mix)")
    g.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    args.mix = [m.strip() for m in args.mix.split(",") if m.strip()]
    bad = [m for m in args.mix if m not in MODALITIES]
    if bad or not args.mix:
        p.error(f"--mix: unknown modality {bad[0] if bad else ''!r}; choose from {', '.join(MODALITIES)}")
    lo, hi = args.input_len
    if not 2 <= lo <= hi:
        p.error("--input-len: need 2 <= MIN <= MAX")
    if not 0 <= args.shared_prefix_len < lo:
        p.error("--shared-prefix-len: must be below the minimum input length")
    if args.num_requests < 1 or args.output_len < 1:
        p.error("--num-requests and --output-len must be positive")
    return args


# ---- environment -----------------------------------------------------------------------------------------


def _git(*cmd: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} logical CPUs)"


def environment(device: torch.device) -> dict:
    # A copy whose .git is missing or stale (the device machine's) is described by G4SERVE_GIT_COMMIT.
    override = envs.get("G4SERVE_GIT_COMMIT")
    dirty = None if override else _git("status", "--porcelain", "--untracked-files=no")
    env = {
        "git_commit": override or _git("rev-parse", "HEAD"),
        "git_dirty_files": dirty.splitlines() if dirty else [],
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
        "command": command_line(),
        "cwd": os.getcwd(),
    }
    if device.type == "cuda":
        env["cuda_version"] = torch.version.cuda
    try:
        import triton  # optional

        env["triton_version"] = triton.__version__
    except ImportError:
        env["triton_version"] = None
    return env


def _host_busy_cpu_s() -> float | None:
    """CPU seconds all processes of this host have spent busy (Linux /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU time other processes took while a run was timed: on a shared machine, a sign the figures are
    off."""

    def __enter__(self) -> Self:
        self.host0, self.own0, self.wall0 = _host_busy_cpu_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        host1, own1, wall1 = _host_busy_cpu_s(), time.process_time(), time.perf_counter()
        self.other_cpu_s = None if self.host0 is None else max(0.0, (host1 - self.host0) - (own1 - self.own0))
        self.own_cpu_s = own1 - self.own0
        capacity = (wall1 - self.wall0) * (os.cpu_count() or 1)
        self.other_cpu_ratio = None if self.other_cpu_s is None else self.other_cpu_s / capacity


# ---- workload ---------------------------------------------------------------------------------------------


def _parse_size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m:
        raise SystemExit(f"--image-size: expected WxH, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def build_prompts(
    engine: LLMEngine,
    args: argparse.Namespace,
    n: int,
    rng: np.random.Generator,
    input_len: tuple[int, int],
    mix: list[str],
) -> tuple[list[dict], list[str]]:
    """``n`` prompt dicts (``prompt_token_ids`` plus optional media) and the modality of each."""
    tok = engine.tokenizer
    vocab = min(tok.vocab_size, engine.model_config.text.vocab_size)
    specials = tok.special_token_ids | {tok.bos_token_id}
    candidates = np.array([i for i in range(vocab) if i not in specials])
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    shared = rng.choice(candidates, args.shared_prefix_len).tolist()
    placeholder = engine.processor.placeholder_ids
    width, height = _parse_size(args.image_size)
    prompts, kinds = [], []
    for i in range(n):
        kind = mix[i % len(mix)]
        length = int(rng.integers(input_len[0], input_len[1] + 1))
        ids = bos + shared + rng.choice(candidates, length - len(bos) - len(shared)).tolist()
        prompt: dict = {"prompt_token_ids": ids}
        if kind != "text":
            # The media placeholder goes right after the shared prefix, like "<image> question".
            at = len(bos) + len(shared)
            ids[at:at] = [placeholder[kind]]
            if kind == "image":
                media = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            elif kind == "audio":
                media = (0.2 * rng.standard_normal(int(16000 * args.audio_seconds))).astype(np.float32)
            else:
                media = [
                    rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(args.video_frames)
                ]
            prompt["multi_modal_data"] = {kind: [media]}  # a list of items: one image, clip or video
        prompts.append(prompt)
        kinds.append(kind)
    return prompts, kinds


# ---- statistics -------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def latency_figures(outputs: list[RequestOutput]) -> dict:
    metrics = [o.metrics for o in outputs]
    ttft = [m.ttft_s for m in metrics if m.ttft_s is not None]
    itl = [x for m in metrics for x in m.itl_s]
    e2e = [m.finished_time - m.arrival_time for m in metrics if m.finished_time is not None]
    queue = [m.queue_time_s for m in metrics if m.queue_time_s is not None]
    tpot = [
        (m.last_token_time - m.first_token_time) / (len(m.token_times) - 1)
        for m in metrics
        if len(m.token_times) > 1
    ]
    return {
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "ttft_max_s": max(ttft),
        "itl_mean_s": _mean(itl),
        "itl_p50_s": _pct(itl, 50),
        "itl_p95_s": _pct(itl, 95),
        "itl_p99_s": _pct(itl, 99),
        "tpot_mean_s": _mean(tpot),
        "e2e_latency_mean_s": _mean(e2e),
        "e2e_latency_p50_s": _pct(e2e, 50),
        "e2e_latency_p95_s": _pct(e2e, 95),
        "queue_time_mean_s": _mean(queue),
        "queue_time_p95_s": _pct(queue, 95),
    }


# ---- runs -------------------------------------------------------------------------------------------------


def run_engine(
    engine: LLMEngine, processed: list[ProcessedPrompt], params: SamplingParams, prefix: str
) -> dict:
    """Submit everything at once, step until done; returns outputs, wall time and engine counters."""
    kv = engine.kv
    before = {
        "steps": engine.num_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "hit_tokens": kv.prefix_hit_tokens,
        "query_tokens": kv.prefix_query_tokens,
        "encoder_calls": len(engine.encoder.calls),
        "encoder_hits": engine.encoder_cache.hits,
        "encoder_misses": engine.encoder_cache.misses,
    }
    step_times: list[float] = []
    usage_peak = {name: 0.0 for name in kv.pools}
    finished: dict[str, RequestOutput] = {}
    t0 = time.perf_counter()
    for i, proc in enumerate(processed):
        engine.add_request(engine.make_request(f"{prefix}{i}", proc, params))
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - s0)
        for name, used in kv.usage().items():
            usage_peak[name] = max(usage_peak[name], used)
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.perf_counter() - t0
    calls = engine.encoder.calls[before["encoder_calls"] :]
    return {
        "outputs": [finished[f"{prefix}{i}"] for i in range(len(processed))],
        "elapsed_s": elapsed,
        "step_times_s": step_times,
        "num_steps": engine.num_steps - before["steps"],
        "num_preemptions": engine.scheduler.num_preemptions - before["preemptions"],
        "prefix_cache_hit_tokens": kv.prefix_hit_tokens - before["hit_tokens"],
        "prefix_cache_query_tokens": kv.prefix_query_tokens - before["query_tokens"],
        "encoder_calls": len(calls),
        "encoder_time_s": sum(c.seconds for c in calls),
        "encoder_cache_hits": engine.encoder_cache.hits - before["encoder_hits"],
        "encoder_cache_misses": engine.encoder_cache.misses - before["encoder_misses"],
        "kv_usage_peak_ratio": usage_peak,
    }


def run_reference(engine: LLMEngine, processed: list[ProcessedPrompt], params: SamplingParams) -> dict:
    """The same prompts, one at a time, through the unbatched reference loop."""
    token_ids = []
    latencies = []
    t0 = time.perf_counter()
    for i, proc in enumerate(processed):
        request = generate_one(engine.model, engine.make_request(f"ref-{i}", proc, params))
        token_ids.append(request.output_token_ids)
        latencies.append(request.metrics.finished_time - request.metrics.arrival_time)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return {"elapsed_s": time.perf_counter() - t0, "token_ids": token_ids, "latencies_s": latencies}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    text_only = set(args.mix) == {"text"} and not args.load_towers
    extra = {} if args.attention_backend is None else {"attention_backend": args.attention_backend}
    config = EngineConfig(
        **extra,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_beside_decodes=args.max_prefill_tokens_beside_decodes,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        fast_prefill=not args.no_fast_prefill,
        enable_chunked_prefill=not args.no_chunked_prefill,
        text_only=text_only,
        seed=args.seed,
    )
    loadavg_start = os.getloadavg()
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    model_load_s = time.perf_counter() - t0
    env = environment(engine.device)
    text = engine.model_config.text
    print(
        f"model {args.model or 'embedded tiny'} on {env['device_name']} ({engine.dtype}), "
        f"KV capacity {engine.kv.capacity_tokens()} tokens, load {model_load_s:.2f}s",
        flush=True,
    )

    rng = np.random.default_rng(args.seed)
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=args.seed if args.temperature > 0 else None,
    )
    prompts, kinds = build_prompts(engine, args, args.num_requests, rng, tuple(args.input_len), args.mix)
    warm_prompts, _ = build_prompts(
        engine, args, args.warmup_requests, rng, (args.input_len[0],) * 2, args.mix
    )
    t0 = time.perf_counter()
    processed = [engine.process_prompt(p) for p in prompts]
    preprocess_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    if warm_prompts:
        run_engine(
            engine,
            [engine.process_prompt(p) for p in warm_prompts],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            "warmup-",
        )
        engine.kv.reset_prefix_cache()
    warmup_s = time.perf_counter() - t0
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)

    print(
        f"running {args.num_requests} requests ({', '.join(f'{kinds.count(m)} {m}' for m in args.mix)}) ...",
        flush=True,
    )
    with OtherLoad() as load:
        run = run_engine(engine, processed, params, "bench-")
    outputs, elapsed = run["outputs"], run["elapsed_s"]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert output_tokens == args.num_requests * args.output_len, (
        "every request must generate --output-len tokens"
    )
    steps = run["step_times_s"]
    figures = {
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "prompt_tokens_per_s": prompt_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        **latency_figures(outputs),
        "num_steps": run["num_steps"],
        "step_time_mean_s": _mean(steps),
        "step_time_p50_s": _pct(steps, 50),
        "step_time_max_s": max(steps),
        "num_preemptions": run["num_preemptions"],
        "prefix_cache_hit_tokens": run["prefix_cache_hit_tokens"],
        "prefix_cache_query_tokens": run["prefix_cache_query_tokens"],
        "prefix_cache_hit_ratio": (
            run["prefix_cache_hit_tokens"] / run["prefix_cache_query_tokens"]
            if run["prefix_cache_query_tokens"]
            else 0.0
        ),
        "encoder_calls": run["encoder_calls"],
        "encoder_time_s": run["encoder_time_s"],
        "encoder_cache_hits": run["encoder_cache_hits"],
        "encoder_cache_misses": run["encoder_cache_misses"],
        "kv_usage_peak_ratio": run["kv_usage_peak_ratio"],
        "prompt_tokens_total": prompt_tokens,
        "prompt_tokens_mean": prompt_tokens / len(outputs),
        "output_tokens_total": output_tokens,
        "own_process_cpu_s": load.own_cpu_s,
        "other_processes_cpu_s": load.other_cpu_s,
        "other_processes_cpu_ratio": load.other_cpu_ratio,
        "model_load_s": model_load_s,
        "preprocess_s": preprocess_s,
        "warmup_s": warmup_s,
    }
    if engine.device.type == "cuda":
        figures["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(engine.device)

    reference = None
    if args.compare_reference:
        print("running the same prompts one at a time through reference.generate_one ...", flush=True)
        with OtherLoad() as ref_load:
            ref = run_reference(engine, processed, params)
        matches = sum(r == o.outputs[0].token_ids for r, o in zip(ref["token_ids"], outputs))
        reference = {
            "elapsed_s": ref["elapsed_s"],
            "requests_per_s": len(outputs) / ref["elapsed_s"],
            "output_tokens_per_s": output_tokens / ref["elapsed_s"],
            "total_tokens_per_s": (prompt_tokens + output_tokens) / ref["elapsed_s"],
            "request_latency_mean_s": _mean(ref["latencies_s"]),
            "speedup_output_tokens_per_s": figures["output_tokens_per_s"]
            / (output_tokens / ref["elapsed_s"]),
            "requests_with_identical_tokens": matches,
            "other_processes_cpu_s": ref_load.other_cpu_s,
            "other_processes_cpu_ratio": ref_load.other_cpu_ratio,
        }

    cfg = asdict(config)
    result = {
        "benchmark": "offline_throughput",
        **env,
        "loadavg_1m_5m_15m_start": list(loadavg_start),
        "loadavg_1m_5m_15m_end": list(os.getloadavg()),
        "model": args.model or "embedded tiny (g4serve.tiny, variant e)",
        "model_summary": {
            "num_hidden_layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size,
            "vocab_size": text.vocab_size,
            "sliding_window": text.sliding_window,
            "num_kv_shared_layers": text.num_kv_shared_layers,
            "parameters": sum(p.numel() for p in engine.model.parameters()),
            "dtype": str(engine.dtype).removeprefix("torch."),
        },
        "attention_backend": type(engine.runner.backend).__name__,
        "kv_capacity_tokens": engine.kv.capacity_tokens(),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,  # the engine's, when none was given
        "parameters": {
            **vars(args),
            "engine_config": cfg,
            "requests_per_modality": {m: kinds.count(m) for m in args.mix},
        },
        "figures": figures,
        "reference": reference,
    }
    print_summary(result)
    if not args.no_save:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        slug = re.sub(
            r"[^a-z0-9]+", "-", (env["device_name"] if engine.device.type == "cuda" else "cpu").lower()
        ).strip("-")
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.tag or "-".join(args.mix))
        model = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(args.model).name if args.model else "tiny")
        path = out_dir / f"offline_throughput_{stamp}_{slug}_{model}_{tag}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result


def print_summary(result: dict) -> None:
    f = result["figures"]
    print(f"  requests/s          {f['requests_per_s']:.2f}")
    print(f"  output tokens/s     {f['output_tokens_per_s']:.1f}")
    print(
        f"  total tokens/s      {f['total_tokens_per_s']:.1f}   ({f['prompt_tokens_total']} prompt + "
        f"{f['output_tokens_total']} output tokens in {f['elapsed_s']:.2f} s)"
    )
    print(f"  TTFT mean/p50/p95   {f['ttft_mean_s']:.3f} / {f['ttft_p50_s']:.3f} / {f['ttft_p95_s']:.3f} s")
    print(f"  ITL p50/p95         {f['itl_p50_s'] * 1e3:.1f} / {f['itl_p95_s'] * 1e3:.1f} ms")
    if f["other_processes_cpu_ratio"] is not None:
        print(
            f"  other processes used {f['other_processes_cpu_ratio']:.0%} of the host's "
            "CPU time during the run"
        )
    print(
        f"  steps {f['num_steps']}, preemptions {f['num_preemptions']}, "
        f"prefix-cache hit ratio {f['prefix_cache_hit_ratio']:.3f}, encoder calls {f['encoder_calls']}"
    )
    ref = result["reference"]
    if ref:
        print(
            f"  reference (one at a time): {ref['output_tokens_per_s']:.1f} output tokens/s "
            "-> continuous batching "
            f"x{ref['speedup_output_tokens_per_s']:.2f}; identical tokens in "
            f"{ref['requests_with_identical_tokens']}/{result['parameters']['num_requests']} requests"
        )


if __name__ == "__main__":
    main()
