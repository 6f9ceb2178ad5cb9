"""Issue 23's table in one device call: every row measured on this commit and on the one before, side by side.

Two sides, ``now`` (this tree) and ``before`` (``--base``: a tree with that commit's ``src/`` and ``bench/``,
e.g. ``git archive <sha> src bench``), each with its own sources and its own bench scripts. Each side has two
jobs, run in parallel on their own GPU (``CUDA_VISIBLE_DEVICES``); with fewer GPUs than jobs, the jobs share
them in turn:

- ``engine``: ``bench/engine_microbench.py`` on e4b (decode ITL at B = 1 and 64, greedy; B = 1 sampled with
  ``temperature=0.8, top_p=0.95, seed=1``) and on 26b-a4b (B = 1 and 8); the seed workloads (30 prompts at
  once: e4b 7,000 in / 10 out, e2b and 26b-a4b 3,000 / 100; ``bench/offline_throughput.py``); 31B's load;
- ``served``: one ``g4serve serve --preset e4b --max-num-seqs 64``, its time to ``/health``, then in turn:
  the first video burst (24 QPS right after 8 warm-up requests), videos at 1 QPS, videos at 32 / 48 / 64
  QPS, eight text streams alone and beside 32 video QPS, text of 500 / 128 tokens at 32 and 64 QPS, audio
  clips at 4 QPS, and the text streams beside 32 audio QPS.

Four GPUs run all four jobs at once, in under ten minutes; with two, run ``--sides now`` and
``--sides before`` as two calls, then ``--table-only`` over both sides' directories. Writes every run's
JSON and log under ``--out``, then ``issue_table.json`` and ``issue_table.md`` (row, before, now, goal). A
job that fails or runs out of time leaves its rows empty ("–"), not the call.

    python bench/issue_table.py --base /tmp/base --out /tmp/out          # on the device, four GPUs
    python bench/issue_table.py --smoke --out /tmp/smoke                 # the plumbing, tiny model on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from g4serve.bench.common import SubprocessServer
from g4serve.bench.loadgen import wait_for_finished

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("before", "now")
COMPANION_EXTRA_S = 10  # seconds a media run beside text streams outlasts them


@dataclass
class Plan:
    """What one call runs: the model presets, device and durations (``--smoke``: the tiny model on CPU)."""

    device: str = "cuda"
    e4b: str = "e4b"
    e2b: str = "e2b"
    moe: str = "26b-a4b"
    dense31: str = "31b"
    duration: int = 8
    steps: int = 32
    seed_requests: int = 30
    smoke: bool = False
    serve_args: list[str] = field(default_factory=list)

    @classmethod
    def smoke_plan(cls) -> Plan:
        return cls("cpu", "tiny", "tiny", "tiny", "tiny", 2, 4, 4, True, ["--attention-backend", "torch"])


def engine_runs(plan: Plan, out: Path) -> list[tuple[str, list[str]]]:
    """(name, argv relative to the side's tree) of the engine job; each run writes under out/name."""
    # the backend named: older sources' microbenchmark defaulted to the PyTorch reference attention
    backend = "triton" if plan.device == "cuda" else "torch"
    micro = f"bench/engine_microbench.py --device {plan.device} --decode-steps {plan.steps}".split()
    micro += ["--attention-backend", backend]
    short = "--prefill-lengths 128 --prefill-reps 1".split()
    runs = [
        ("greedy", [*micro, "--model", plan.e4b, "--batches", "1,64",
                    *"--prefill-lengths 2048 --prefill-reps 2".split()]),
        ("sampled", [*micro, "--model", plan.e4b, "--batches", "1", *short,
                     *"--temperature 0.8 --top-p 0.95 --seed 1".split()]),
        ("moe", [*micro, "--model", plan.moe, "--batches", "1,8", *short]),
    ]  # fmt: skip
    runs = [(name, [*argv, "--out", str(out / name)]) for name, argv in runs]
    seeds = {
        "seed-e4b": (plan.e4b, 7000, 10),
        "seed-e2b": (plan.e2b, 3000, 100),
        "seed-moe": (plan.moe, 3000, 100),
    }
    for name, (model, inp, outp) in seeds.items():
        inp, outp = (64, 4) if plan.smoke else (inp, outp)
        argv = f"bench/offline_throughput.py --model {model} --device {plan.device} --num-requests "
        argv += f"{plan.seed_requests} --input-len {inp} {inp} --output-len {outp}"
        runs.append((name, [*argv.split(), "--out-dir", str(out / name)]))
    # last: the issue's own base did not load 31B within 280 s, which would leave the seed rows no time
    load = [*micro, "--model", plan.dense31, "--batches", "1", "--decode-steps", "4", *short]
    runs.append(("load-31b", [*load, "--out", str(out / "load-31b")]))
    return runs


def served_runs(plan: Plan, url: str) -> tuple[list[tuple[str, list[str]]], dict[str, tuple[str, list[str]]]]:
    """(name, g4serve bench arguments) of the served job's runs, in order (the first is the cold burst), and
    the media runs that go beside some of them (by the name of the run they go beside)."""
    rates = {"burst": 24, "videos": "32,48,64", "texts": "32,64", "media": 32, "audio": 4}
    if plan.smoke:
        rates = {"burst": 1, "videos": "1,2", "texts": "1,2", "media": 1, "audio": 1}
    base = f"--base-url {url} --no-plots --drain-timeout 60 --duration {plan.duration}"
    streams = f"{base} --workload text --output-tokens 128 --concurrency 8 --warmup 4"
    runs = {  # the cold burst first, right after /health
        "cold-burst": f"{base} --workload video --rates {rates['burst']} --warmup 8",
        "video-1qps": f"{base} --workload video --rates 1 --warmup 2",  # the burst's videos: seen before
        "video-1qps-new": f"{base} --workload video --rates 1 --warmup 2 --seed 2",  # videos not seen before
        "video-sweep": f"{base} --workload video --rates {rates['videos']} --warmup 4",
        "text-alone": streams,
        "text-beside-video": streams,  # with "video-beside" running
        "text-saturation": f"{base} --workload text --prompt-tokens 500 --output-tokens 128 --rates "
        f"{rates['texts']} --warmup 4",
        "audio-4qps": f"{base} --workload audio --rates {rates['audio']} --warmup 2",
        "text-beside-audio": streams,  # with "audio-beside" running
    }
    # A companion starts first and runs COMPANION_EXTRA_S longer than the text point, so the media arrive
    # during all of it (the text bench's calibration and warm-up take a few seconds before its point).
    longer = f"--duration {plan.duration + COMPANION_EXTRA_S}"
    beside = {
        "text-beside-video": (
            "video-beside",
            f"{base} --workload video --rates {rates['media']} --warmup 2 --seed 1 {longer}",
        ),
        "text-beside-audio": (
            "audio-beside",
            f"{base} --workload audio --rates {rates['media']} --warmup 2 --seed 1 {longer}",
        ),
    }
    return [(name, args.split()) for name, args in runs.items()], {
        name: (other, args.split()) for name, (other, args) in beside.items()
    }


def _env(tree: Path, gpu: str | None) -> dict[str, str]:
    """The side's sources first on the path, no other side's (the device's setup puts this tree's there)."""
    env = dict(os.environ)
    theirs = {str(ROOT / "src"), str(tree / "src")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in theirs]
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), *paths])
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        try:
            return subprocess.run(
                argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[issue_table] timed out after {timeout:.0f} s\n")
            return 124


def engine_job(tree: Path, out: Path, plan: Plan, gpu: str | None, deadline: float) -> None:
    env = _env(tree, gpu)
    for name, argv in engine_runs(plan, out):
        left = deadline - time.monotonic()
        if left < 20:
            break
        rc = _run([sys.executable, *argv], tree, env, out / f"{name}.log", left)
        (out / f"{name}.rc").write_text(str(rc))


def served_job(tree: Path, out: Path, plan: Plan, gpu: str | None, deadline: float) -> None:
    env = _env(tree, gpu)
    serve = ["--preset", plan.e4b, "--device", plan.device, "--max-num-seqs", "64", *plan.serve_args]
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with (out / "server.log").open("w") as log:
        try:
            server = SubprocessServer(
                serve, min(300.0, deadline - time.monotonic()), env=env, cwd=tree, log=log
            )
        except RuntimeError as exc:  # exited, or not healthy in time: the served rows stay empty
            log.write(f"\n[issue_table] {exc}\n")
            (out / "ready.json").write_text(json.dumps({"ready_s": None}))
            return
        (out / "ready.json").write_text(json.dumps({"ready_s": time.monotonic() - start}))
        try:
            runs, beside = served_runs(plan, server.base_url)
            bench = [sys.executable, "-m", "g4serve.cli", "bench"]
            for name, args in runs:
                left = deadline - time.monotonic()
                if left < 20:
                    break
                companion = None
                if name in beside:
                    other, other_args = beside[name]
                    companion = subprocess.Popen(
                        [*bench, *other_args, "--label", other, "--out", str(out / other)],
                        cwd=tree,
                        env=env,
                        stdout=(out / f"{other}.log").open("w"),
                        stderr=subprocess.STDOUT,
                    )
                    # the text point starts once the media arrive (its warm-up 2, then 8 of its point)
                    wait_for_finished(server.base_url, 10, timeout_s=max(1.0, min(120.0, left - 60)))
                _run(
                    [*bench, *args, "--label", name, "--out", str(out / name)],
                    tree,
                    env,
                    out / f"{name}.log",
                    left,
                )
                if companion is not None:
                    try:
                        companion.wait(timeout=max(1.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        companion.kill()
        finally:
            server.stop()


# ---- the table --------------------------------------------------------------------------------------------
def _json(directory: Path) -> dict | None:
    """The newest JSON result under ``directory`` (one run writes one), or None."""
    files = sorted(directory.glob("**/*.json"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    files = [f for f in files if f.name != "ready.json"]
    return json.loads(files[-1].read_text()) if files else None


def _points(side: Path, name: str) -> list[dict]:
    result = _json(side / "served" / name)
    return result["points"] if result else []


def _decode_ms(side: Path, run: str, batch: int) -> float | None:
    result = _json(side / "engine" / run)
    for row in (result or {}).get("decode", []):
        if row.get("batch") == batch:
            return row["itl_p50_ms"]
    return None


def _ms(value: float | None, scale: float = 1e3) -> str:
    return "–" if value is None else f"{value * scale:.1f}"


def _served(side: Path, run: str, *keys: str, sep: str = " / ") -> str:
    """Figures ``keys`` of ``run``'s first point in ms (``server.<key>``: the server's), joined by ``sep``."""
    points = _points(side, run)
    point = points[0] if points else {}
    server = point.get("server") or {}
    return sep.join(_ms(server.get(k[7:]) if k.startswith("server.") else point.get(k)) for k in keys)


def _best_video_rate(points: list[dict]) -> str:
    ok = [
        p["rate_qps"]
        for p in points
        if p.get("e2e_p95_s") is not None
        and p["e2e_p95_s"] <= 0.3
        and p["requests_completed"] >= 0.95 * max(1, p["requests_sent"])
    ]
    tried = ", ".join(f"{p['rate_qps']:g}: {_ms(p.get('e2e_p95_s'))} ms" for p in points)
    if not points:
        return "–"
    return f"{max(ok):g} QPS (p95 E2E {tried})" if ok else f"none (p95 E2E {tried})"


def _saturation(points: list[dict]) -> str:
    if not points:
        return "–"
    best = max(points, key=lambda p: p["output_tokens_per_s"])
    itl = _ms(best["itl_p50_s"])
    return f"{best['output_tokens_per_s']:,.0f} tok/s at {best['rate_qps']:g} QPS (ITL p50 {itl} ms)"


def _seed(side: Path, name: str) -> str:
    result = _json(side / "engine" / name)
    return "–" if result is None else f"{result['figures']['total_tokens_per_s'] / 1e3:.1f}k"


ROWS: list[tuple[str, str, Callable[[Path], str]]] = [
    ("decode ITL, B=1, greedy (ms)", "<= 3.4", lambda s: _ms(_decode_ms(s, "greedy", 1), 1)),
    (
        "decode ITL, B=1, temperature 0.8, top-p 0.95, seed 1 (ms)",
        "<= greedy + 0.2",
        lambda s: _ms(_decode_ms(s, "sampled", 1), 1),
    ),
    ("decode ITL, B=64 (ms)", "<= 5.0", lambda s: _ms(_decode_ms(s, "greedy", 64), 1)),
    (
        "26b-a4b decode ITL, B=1 / B=8 (ms)",
        "<= 4.0 / <= 8.0",
        lambda s: f"{_ms(_decode_ms(s, 'moe', 1), 1)} / {_ms(_decode_ms(s, 'moe', 8), 1)}",
    ),
    (
        "video (6 x 480p) TTFT p50 at 1 QPS; server prepare mean (ms): videos seen before (the burst's), new",
        "<= 25; <= 5",
        lambda s: (
            f"{_served(s, 'video-1qps', 'ttft_p50_s', 'server.prepare_mean_s', sep='; ')}, new: "
            f"{_served(s, 'video-1qps-new', 'ttft_p50_s', 'server.prepare_mean_s', sep='; ')}"
        ),
    ),
    (
        "text ITL p50 / p95 under 32 video QPS (ms; alone)",
        "<= 5 / <= 7",
        lambda s: (
            f"{_served(s, 'text-beside-video', 'itl_p50_s', 'itl_p95_s')} "
            f"({_served(s, 'text-alone', 'itl_p50_s', 'itl_p95_s')})"
        ),
    ),
    (
        "highest video QPS with p95 E2E <= 300 ms (10 output tokens)",
        ">= 64",
        lambda s: _best_video_rate(_points(s, "video-sweep")),
    ),
    (
        "first burst after start, 24 video QPS: TTFT p95 / E2E p95 (ms); ready after",
        "no cold penalty",
        lambda s: f"{_served(s, 'cold-burst', 'ttft_p95_s', 'e2e_p95_s')}; {_ready(s)}",
    ),
    (
        "served text 500 in / 128 out: output tok/s at saturation",
        ">= 10k at ITL p50 <= 10 ms",
        lambda s: _saturation(_points(s, "text-saturation")),
    ),
    (
        "audio TTFT p50 at 4 QPS; encoder mean (ms)",
        "<= 25; <= 10",
        lambda s: _served(s, "audio-4qps", "ttft_p50_s", "server.encoder_mean_s", sep="; "),
    ),
    (
        "text ITL p50 under 32 audio QPS (ms)",
        "<= 7",
        lambda s: _served(s, "text-beside-audio", "itl_p50_s"),
    ),
    (
        "seed workloads, 30 prompts: e4b 7000/10, e2b 3000/100, 26b-a4b 3000/100 (total tok/s)",
        "26b-a4b >= 60k",
        lambda s: f"{_seed(s, 'seed-e4b')}, {_seed(s, 'seed-e2b')}, {_seed(s, 'seed-moe')}",
    ),
    (
        "31b bf16: load and warm-up (s)",
        "reported",
        lambda s: _ms((_json(s / "engine" / "load-31b") or {}).get("load_s"), 1),
    ),
]


def _ready(side: Path) -> str:
    path = side / "served" / "ready.json"
    ready = json.loads(path.read_text()).get("ready_s") if path.is_file() else None
    return "–" if ready is None else f"{ready:.0f} s"


def build_table(out: Path, meta: dict) -> tuple[dict, str]:
    rows = [
        {"row": name, "goal": goal, **{side: value(out / side) for side in SIDES}}
        for name, goal, value in ROWS
    ]
    table = {"meta": meta, "rows": rows}
    lines = [
        f"Issue 23's table, {meta.get('device', '?')}, {meta.get('date', '?')}: "
        f"now `{meta.get('now', '?')}`, before `{meta.get('before', '?')}`; `{meta.get('command', '')}`",
        "",
        "| row | before | now | goal |",
        "|---|---|---|---|",
        *(f"| {r['row']} | {r['before']} | {r['now']} | {r['goal']} |" for r in rows),
    ]
    return table, "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base", help="the commit before: a tree with its src/ and bench/ (no before side without)"
    )
    p.add_argument("--out", default="/tmp/issue-table")
    p.add_argument("--deadline", type=float, default=560.0, help="seconds for the whole call")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to spread the jobs over (default: all)")
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, short runs: the plumbing")
    p.add_argument("--sides", default="before,now", help="which sides to run (the table shows both)")
    p.add_argument(
        "--jobs", default="served,engine", help="which jobs each side runs (one GPU: the engine's rows alone)"
    )
    p.add_argument("--table-only", action="store_true", help="run nothing: the table from --out's results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from g4serve.bench.meta import command_line, device_name, git_commit

    args = parse_args(argv)
    plan = Plan.smoke_plan() if args.smoke else Plan()
    out = Path(args.out)
    trees = {"now": ROOT, "before": Path(args.base).resolve() if args.base else None}
    sides = [s for s in args.sides.split(",") if s in SIDES and trees[s] is not None]
    if args.table_only:
        sides = []
    for side in sides:
        shutil.rmtree(out / side, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in ("served", "engine") if k in args.jobs.split(",")]
    jobs: list[tuple[str, str]] = [(side, kind) for side in sides for kind in kinds]
    gpus = args.gpus
    if gpus is None:
        gpus = 0 if plan.device == "cpu" else _gpu_count()
    deadline = time.monotonic() + args.deadline - 15
    slots = max(1, gpus)
    lanes: list[list[tuple[str, str]]] = [jobs[i::slots] for i in range(slots)]

    def lane(index: int, work: list[tuple[str, str]]) -> None:
        gpu = str(index) if gpus else None
        for side, kind in work:
            tree, target = trees[side], out / side / kind
            if kind == "engine":
                engine_job(tree, target, plan, gpu, deadline)
            else:
                served_job(tree, target, plan, gpu, deadline)

    threads = [threading.Thread(target=lane, args=(i, w)) for i, w in enumerate(lanes) if w]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meta = {
        "device": device_name(plan.device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "now": git_commit(),
        "before": (Path(args.base) / "COMMIT").read_text().strip()
        if args.base and (Path(args.base) / "COMMIT").is_file()
        else args.base,
        "command": command_line(),
        "gpus": gpus,
    }
    table, markdown = build_table(out, meta)
    (out / "issue_table.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / "issue_table.md").write_text(markdown)
    print(markdown)
    return 0


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    raise SystemExit(main())
