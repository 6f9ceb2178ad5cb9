"""Per-point metrics from per-request timings, and the outputs: results.json, results.md, PNG plots, and
``compare`` (several results files side by side, with ratios to the first).

ITL from a stream: a chunk's arrival is all the client sees, and a chunk may carry several tokens (a
token without text yet is held back and sent with the next). For a request with N output tokens
(``usage.completion_tokens``) in K content chunks, the first chunk is taken to carry the first token
(TTFT) and the other N-1 tokens are spread evenly over the K-1 gaps: each gap contributes one ITL
sample of ``gap / r`` with weight ``r = (N-1)/(K-1)`` tokens, and ITL percentiles are token-weighted
(nearest rank). With one token per chunk this is the plain chunk gap. Offline runs use the engine's
exact per-token times. TTFT and E2E percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from g4serve.bench.loadgen import PointRun, RequestResult

PLOTS = (  # file, y key, y label, scale
    ("ttft_p95.png", "ttft_p95_s", "TTFT p95 (ms)", 1e3),
    ("itl_p50.png", "itl_p50_s", "ITL p50 (ms)", 1e3),
    ("e2e_p95.png", "e2e_p95_s", "E2E latency p95 (s)", 1.0),
    ("throughput.png", "output_tokens_per_s", "output tokens/s", 1.0),
)
MAX_FIRST_ERRORS = 5
LATE_SEND_S = 0.05  # a send this late (open loop) is flagged in results.md


# ---- statistics --------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]); None for no values."""
    if not len(values):
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def weighted_percentile(values: Sequence[float], weights: Sequence[float], q: float) -> float | None:
    """Smallest value whose cumulative weight reaches ``q``% of the total (nearest rank)."""
    if not len(values):
        return None
    order = np.argsort(np.asarray(values, dtype=np.float64), kind="stable")
    v = np.asarray(values, dtype=np.float64)[order]
    cum = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    target = q / 100.0 * cum[-1]
    return float(v[min(int(np.searchsorted(cum, target - 1e-12 * cum[-1])), len(v) - 1)])


def itl_samples(result: RequestResult) -> tuple[list[float], list[float]]:
    """(ITL values, token weights) of one request, as described in the module docstring."""
    if result.token_times_s is not None:
        gaps = [b - a for a, b in itertools.pairwise(result.token_times_s)]
        return gaps, [1.0] * len(gaps)
    chunks = result.chunk_times_s
    n = result.output_tokens if result.output_tokens is not None else len(chunks)
    if len(chunks) < 2 or n < 2:
        return [], []
    per_gap = (n - 1) / (len(chunks) - 1)
    return [(b - a) / per_gap for a, b in itertools.pairwise(chunks)], [per_gap] * (len(chunks) - 1)


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first: (last content - first content) / (N - 1)."""
    n = result.output_tokens or 0
    if n < 2 or result.ttft_s is None:
        return None
    times = result.token_times_s if result.token_times_s is not None else result.chunk_times_s
    last = times[-1] if len(times) >= 2 else result.e2e_s
    return (last - result.ttft_s) / (n - 1)


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def summarize_point(
    run: PointRun, load: dict[str, Any], server: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The metrics of one load point. ``load`` names the point (``mode``, ``rate_qps`` or
    ``concurrency``...)."""
    results = run.results
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    itl_values: list[float] = []
    itl_weights: list[float] = []
    for r in ok:
        v, w = itl_samples(r)
        itl_values += v
        itl_weights += w
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    sent = sorted(r.sent_s for r in results if math.isfinite(r.sent_s))
    lags = [
        r.sent_s - r.scheduled_s for r in results if r.scheduled_s is not None and math.isfinite(r.sent_s)
    ]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    wall = max(run.wall_s, 1e-9)
    first_errors: list[str] = []
    for r in errors:
        if r.error not in first_errors:
            first_errors.append(r.error)
        if len(first_errors) == MAX_FIRST_ERRORS:
            break
    point: dict[str, Any] = {
        **load,
        "requests_sent": len(results),
        "requests_completed": len(ok),
        "errors": len(errors),
        "timed_out": run.timed_out,
        "first_errors": first_errors,
        "achieved_send_rate_qps": (len(sent) - 1) / (sent[-1] - sent[0])
        if len(sent) >= 2 and sent[-1] > sent[0]
        else None,
        "client_cpu_share": run.client_cpu_s / wall if run.client_cpu_s is not None else None,
        "send_lag_p50_s": percentile(lags, 50),
        "send_lag_max_s": max(lags) if lags else None,
        "send_window_s": run.send_window_s,
        "duration_s": run.wall_s,
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_mean_s": float(np.average(itl_values, weights=itl_weights)) if itl_values else None,
        "itl_p50_s": weighted_percentile(itl_values, itl_weights, 50),
        "itl_p95_s": weighted_percentile(itl_values, itl_weights, 95),
        "itl_p99_s": weighted_percentile(itl_values, itl_weights, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p95_s": percentile(tpots, 95),
        "e2e_mean_s": _mean(e2e),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "e2e_p99_s": percentile(e2e, 99),
        "output_tokens_total": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "mean_prompt_tokens": _mean([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "mean_output_tokens": _mean([r.output_tokens for r in ok if r.output_tokens is not None]),
        "server": server,
    }
    return point


def offline_stages(run: PointRun) -> dict[str, Any] | None:
    """The engine's own stage split of an offline point (same keys as the /metrics split)."""
    ok = [r for r in run.results if r.ok and r.stages]
    if not ok:
        return None
    queue = [r.stages["queue_s"] for r in ok if r.stages.get("queue_s") is not None]
    encoder = [r.stages["encoder_s"] for r in ok if r.stages.get("encoder_s")]
    return {
        "queue_mean_s": _mean(queue),
        "queue_count": len(queue),
        "encoder_mean_s": _mean(encoder),
        "encoder_count": len(encoder),
        "ttft_mean_s": _mean([r.ttft_s for r in ok]),
        "ttft_count": len(ok),
        "e2e_mean_s": _mean([r.e2e_s for r in ok]),
        "e2e_count": len(ok),
    }


# ---- files -------------------------------------------------------------------------------------------------
def x_key(points: Sequence[dict[str, Any]]) -> str:
    """``rate_qps`` for open-loop sweeps, ``concurrency`` for closed-loop ones."""
    return "concurrency" if points and points[0].get("mode") == "concurrency" else "rate_qps"


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def markdown_table(result: dict[str, Any]) -> str:
    meta, points = result["meta"], result["points"]
    key = x_key(points)
    lines = [
        f"# g4serve bench: {meta.get('label')} — {meta['workload']['name']}",
        "",
        f"- model: `{meta.get('model')}`; target: {meta.get('target')}",
        (
            f"- device: {meta.get('device')}; torch {meta.get('torch_version')}; "
            f"python {meta.get('python_version')}"
        ),
        f"- git: `{meta.get('git_commit')}`; date: {meta.get('date')}",
        f"- workload: `{json.dumps(meta['workload'])}`",
        f"- load: `{json.dumps(meta.get('load'))}`",
        f"- command: `{meta.get('command')}`",
        "",
        (
            f"| {'QPS' if key == 'rate_qps' else 'conc.'} | sent | done | err | send QPS "
            "| TTFT p50/p95/p99 ms | ITL p50/p95 ms | E2E p50/p95/p99 s | out tok/s | req/s | prompt tok "
            "| out tok "
            "| server prep / queue / enc / TTFT ms |"
        ),
        "|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---|",
    ]
    for p in points:
        server = p.get("server") or {}
        split = (
            " / ".join(
                _fmt(server.get(k), 1e3)
                for k in ("prepare_mean_s", "queue_mean_s", "encoder_mean_s", "ttft_mean_s")
            )
            if server
            else "–"
        )
        lines.append(
            f"| {p.get(key)} | {p['requests_sent']} | {p['requests_completed']} | {p['errors']} "
            f"| {_fmt(p.get('achieved_send_rate_qps'), digits=2)} "
            f"| {_fmt(p['ttft_p50_s'], 1e3)} / {_fmt(p['ttft_p95_s'], 1e3)} / {_fmt(p['ttft_p99_s'], 1e3)} "
            f"| {_fmt(p['itl_p50_s'], 1e3)} / {_fmt(p['itl_p95_s'], 1e3)} "
            f"| {_fmt(p['e2e_p50_s'], digits=3)} / {_fmt(p['e2e_p95_s'], digits=3)} "
            f"/ {_fmt(p['e2e_p99_s'], digits=3)} "
            f"| {_fmt(p['output_tokens_per_s'])} | {_fmt(p['requests_per_s'], digits=2)} "
            f"| {_fmt(p['mean_prompt_tokens'], digits=0)} | {_fmt(p['mean_output_tokens'], digits=1)} "
            f"| {split} |"
        )
    late = [p for p in points if (p.get("send_lag_max_s") or 0) > LATE_SEND_S]
    if late:
        worst_ms = max(p["send_lag_max_s"] for p in late) * 1e3
        where = ", ".join(str(p.get(key)) for p in late)
        warning = (
            f"**Warning**: sends fell behind schedule (by up to {worst_ms:.0f} ms at {where}): the load "
            "generator was starved of CPU (or of the GIL, with --in-process-server); those points "
            "understate the offered load."
        )
        lines += ["", warning]
    errs = [(p.get(key), e) for p in points for e in p.get("first_errors", [])]
    if errs:
        lines += ["", "Errors (first messages):", ""] + [f"- at {x}: {e}" for x, e in errs]
    return "\n".join(lines) + "\n"


def plot_runs(
    out_dir: Path, runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], title: str = ""
) -> list[Path]:
    """One PNG per metric of ``PLOTS``, one line per (label, points); ``title`` prefixes each plot's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = x_key(runs[0][1]) if runs else "rate_qps"
    written = []
    for filename, y, ylabel, scale in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        values = []
        for label, points in runs:
            xy = [(p.get(key), p.get(y)) for p in points if p.get(key) is not None and p.get(y) is not None]
            if xy:
                xs, ys = zip(*sorted(xy))
                values += [v * scale for v in ys]
                ax.plot(xs, [v * scale for v in ys], marker="o", label=label)
        ax.set_xlabel("request rate (QPS)" if key == "rate_qps" else "concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(
            f"{title + ': ' if title else ''}{ylabel} vs {'QPS' if key == 'rate_qps' else 'concurrency'}"
        )
        ax.grid(True, alpha=0.3)
        positive = [v for v in values if v > 0]
        if positive and max(positive) / min(positive) > 50:
            ax.set_yscale("log")  # systems orders of magnitude apart: a linear axis flattens the faster one
        else:
            ax.set_ylim(bottom=0)
        if runs:
            ax.legend()
        written.append(save_figure(fig, out_dir / filename))
    return written


def save_figure(fig, path: Path) -> Path:
    """Lay out, write and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_results(out_dir: str | Path, result: dict[str, Any], *, plots: bool = True) -> dict[str, Path]:
    """``results.json``, ``results.md`` and the plots in ``out_dir`` (created)."""

    def plot(out: Path) -> list[Path]:
        return plot_runs(
            out,
            [(result["meta"].get("label") or "run", result["points"])],
            title=result["meta"].get("workload", {}).get("name", ""),
        )

    return write_outputs(out_dir, "results", result, markdown_table(result), plot if plots else None)


def write_outputs(
    out_dir: str | Path,
    stem: str,
    result: dict[str, Any],
    markdown: str,
    plot: Callable[[Path], list[Path]] | None = None,
) -> dict[str, Path]:
    """``<stem>.json`` (``result``), ``<stem>.md`` (``markdown``) and whatever ``plot(out_dir)`` draws, in
    ``out_dir`` (created) -> {"json", "md", plot file stems: paths}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
    paths["md"].write_text(markdown)
    for path in plot(out) if plot is not None else []:
        paths[path.stem] = path
    return paths


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ---- compare -----------------------------------------------------------------------------------------------
COMPARE_METRICS = (  # key, header, scale, digits
    ("ttft_p50_s", "TTFT p50 ms", 1e3, 1),
    ("ttft_p95_s", "TTFT p95 ms", 1e3, 1),
    ("itl_p50_s", "ITL p50 ms", 1e3, 2),
    ("itl_p95_s", "ITL p95 ms", 1e3, 2),
    ("e2e_p95_s", "E2E p95 s", 1.0, 3),
    ("output_tokens_per_s", "out tok/s", 1.0, 1),
    ("requests_per_s", "req/s", 1.0, 2),
)


def load_results(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "points" not in data or "meta" not in data:
        raise ValueError(f"{path}: not a g4serve bench results.json (needs 'meta' and 'points')")
    return data


def compare(  # noqa: C901 - one markdown table: input checks, header, and per-point rows with ratios to the baseline
    paths: Sequence[str | Path],
    out_dir: str | Path,
    labels: Sequence[str] | None = None,
    *,
    plots: bool = True,
) -> dict[str, Path]:
    """Side-by-side plots and a markdown table of several results files, each value with its ratio to the
    first file's value at the same QPS (or concurrency)."""
    if len(paths) < 2:
        raise ValueError("compare: give at least two results.json files")
    runs = [load_results(p) for p in paths]
    if labels and len(labels) != len(runs):
        raise ValueError(f"--labels: {len(labels)} labels for {len(runs)} files")
    names = (
        list(labels)
        if labels
        else [r["meta"].get("label") or Path(p).parent.name or Path(p).stem for r, p in zip(runs, paths)]
    )
    names = [n if names.count(n) == 1 else f"{n} ({i + 1})" for i, n in enumerate(names)]
    keys = {x_key(r["points"]) for r in runs}
    if len(keys) > 1:
        raise ValueError("compare: the files mix rate sweeps and concurrency sweeps")
    key = keys.pop()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    baseline = {p.get(key): p for p in runs[0]["points"]}
    xs = sorted({p.get(key) for r in runs for p in r["points"] if p.get(key) is not None})
    lines = [f"# g4serve bench compare ({key}; ratios to {names[0]})", ""]
    for name, r, path in zip(names, runs, paths):
        meta = r["meta"]
        lines.append(
            f"- **{name}**: `{path}` — model `{meta.get('model')}`, workload "
            f"`{meta.get('workload', {}).get('name')}`, device {meta.get('device')}, "
            f"git `{meta.get('git_commit')}`, {meta.get('date')}"
        )
    workloads = {json.dumps(r["meta"].get("workload"), sort_keys=True) for r in runs}
    if len(workloads) > 1:
        lines += ["", "**Warning**: the files were run with different workload parameters."]
    header = [("QPS" if key == "rate_qps" else "conc."), "system", "done/sent", "err"] + [
        h for _, h, _, _ in COMPARE_METRICS
    ]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for x in xs:
        base = baseline.get(x)
        for name, r in zip(names, runs):
            p = next((p for p in r["points"] if p.get(key) == x), None)
            if p is None:
                continue
            cells = [str(x), name, f"{p['requests_completed']}/{p['requests_sent']}", str(p["errors"])]
            for metric, _, scale, digits in COMPARE_METRICS:
                value = p.get(metric)
                cell = _fmt(value, scale, digits)
                ref = base.get(metric) if base is not None else None
                if r is not runs[0] and value is not None and ref:
                    cell += f" ({value / ref:.2f}×)"
                cells.append(cell)
            lines.append("| " + " | ".join(cells) + " |")
    written = {"md": out / "compare.md"}
    written["md"].write_text("\n".join(lines) + "\n")
    if plots:
        title = "/".join(sorted({str(r["meta"].get("workload", {}).get("name")) for r in runs}))
        for path in plot_runs(out, [(n, r["points"]) for n, r in zip(names, runs)], title=title):
            written[path.stem] = path
    return written
