"""``g4serve bench grid``: the banking extraction workload over a grid of prompt sizes x output lengths x
JSON schema on/off, at one fixed concurrency (or one low rate), against g4serve or any OpenAI-compatible
server. Writes ``grid.json`` (every cell's figures, with units in the key names), ``grid.md`` and plots of
E2E and TTFT p95 against prompt size, one line per output length, solid without schema, dashed with it.

Cells run in grid order (prompt size, then output length, then schema off before on); every cell sends
``--requests-per-cell`` requests of its own (no two cells share a request). The files are rewritten after
every cell (``meta.complete`` is false until the last), so a run stopped by a time limit keeps its cells. The
prompt's cost per word is measured once with the target's tokenizer (as ``g4serve bench`` does) and reused for
every prompt size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from g4serve.bench import loadgen, report
from g4serve.bench.common import (
    add_request_arguments,
    add_target_arguments,
    count_prompt_tokens,
    ints,
    ms,
    run_environment,
    served_model,
    serving_target,
)
from g4serve.bench.workloads import EXTRACTION_SCHEMA, ExtractionWorkload, request_bytes

CELL_COLUMNS = (  # key, header, scale, digits
    ("ttft_p50_s", "TTFT p50 ms", 1e3, 1),
    ("ttft_p95_s", "TTFT p95 ms", 1e3, 1),
    ("e2e_p50_s", "E2E p50 s", 1.0, 3),
    ("e2e_p95_s", "E2E p95 s", 1.0, 3),
    ("itl_p50_s", "ITL p50 ms", 1e3, 2),
    ("output_tokens_per_s", "out tok/s", 1.0, 1),
)
PLOTS = (
    ("e2e_p95.png", "e2e_p95_s", "E2E latency p95 (s)", 1.0),
    ("ttft_p95.png", "ttft_p95_s", "TTFT p95 (ms)", 1e3),
)


def add_grid_arguments(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "grid",
        help="the extraction workload over prompt sizes x output lengths x schema on/off",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("grid")
    g.add_argument(
        "--prompt-tokens",
        type=ints,
        default=list(ExtractionWorkload.PROMPT_SIZES),
        help="target prompt sizes in tokens (default 128,512,1024,2048)",
    )
    g.add_argument(
        "--output-tokens",
        type=ints,
        default=list(ExtractionWorkload.OUTPUT_SIZES),
        help="max_tokens values (default 16,32,64,128)",
    )
    g.add_argument(
        "--schema",
        choices=["both", "off", "on"],
        default="both",
        help="cells without the JSON schema, with it, or both (default both)",
    )
    g.add_argument("--requests-per-cell", type=int, default=20, help="requests per cell (default 20)")
    g.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight per cell (closed loop, default 1)"
    )
    g.add_argument("--rate", type=float, default=None, help="open loop at this QPS instead of --concurrency")
    g.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="requests sent (and excluded) before the grid, per schema setting (default 2)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds in-flight requests get after a cell's sending ends (default 60)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="do not probe the target's tokenizer; assume 1.3 tokens per word",
    )
    add_request_arguments(g)
    add_target_arguments(p.add_argument_group("target"))
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, help="directory for grid.json, grid.md and the plots")
    g.add_argument("--label", default=None, help="system name (stored in grid.json)")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    p.set_defaults(func=run_grid_command)
    return p


def run_grid_command(args: argparse.Namespace) -> int:
    if args.requests_per_cell <= 0 or args.concurrency <= 0 or (args.rate is not None and args.rate <= 0):
        raise ValueError("--requests-per-cell, --concurrency and --rate must be positive")
    if args.warmup < 0:
        raise ValueError("--warmup: must be >= 0")
    with serving_target(args) as (base_url, location, own_server):
        result = asyncio.run(_grid(args, base_url, location, own_server=own_server))
    result["meta"]["complete"] = True
    paths = write_grid(args.out, result, plots=args.plots)
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def grid_cells(args: argparse.Namespace) -> list[tuple[int, int, bool]]:
    schemas = {"both": (False, True), "off": (False,), "on": (True,)}[args.schema]
    return [(p, o, s) for p in args.prompt_tokens for o in args.output_tokens for s in schemas]


async def _grid(
    args: argparse.Namespace, base_url: str, location: str, *, own_server: bool
) -> dict[str, Any]:
    client = loadgen.make_http_client(args.http_client, args.api_key, args.request_timeout)
    chat_url = base_url + "/v1/chat/completions"
    pool = ThreadPoolExecutor(
        max_workers=max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="grid-build"
    )
    try:
        model = args.model or await served_model(client, base_url)
        counts = None
        if args.calibrate:
            probe = ExtractionWorkload(args.seed)
            counts = [
                await count_prompt_tokens(client, chat_url, r, model, args.extra_body)
                for r in probe.calibration_probes()
            ]

        def workload(prompt_tokens: int, output_tokens: int, schema: bool) -> ExtractionWorkload:
            w = ExtractionWorkload(
                args.seed, prompt_tokens=prompt_tokens, output_tokens=output_tokens, schema=schema
            )
            if counts:
                w.set_calibration(counts)
            else:
                w.assume_calibration()
            return w

        def builder(w: ExtractionWorkload, namespace: str):
            return lambda i: request_bytes(
                w.request(namespace, i),
                model,
                ignore_eos=args.ignore_eos,
                temperature=args.temperature,
                show_special_tokens=not args.skip_special_tokens,
                extra_body=args.extra_body,
            )

        cells = grid_cells(args)
        warmup_errors = 0
        # Per schema setting: the first schema request also compiles the schema's grammar, outside the grid.
        for schema in sorted({s for _, _, s in cells}) if args.warmup else ():
            w = workload(cells[0][0], cells[0][1], schema)
            run = await loadgen.run_concurrency_point(
                client,
                chat_url,
                builder(w, f"warmup-{schema}"),
                pool,
                concurrency=min(args.warmup, args.concurrency),
                num_requests=args.warmup,
                drain_timeout_s=args.drain_timeout,
            )
            warmup_errors += sum(not r.ok for r in run.results)
        meta = _meta(
            args,
            model=model,
            target=f"{location} {base_url}",
            http_client=client.name,
            label=args.label or ("g4serve" if own_server else urlparse(base_url).netloc or base_url),
            calibration=workload(cells[0][0], cells[0][1], False).calibration,
            warmup_errors=warmup_errors,
        )
        points, notes = [], set()
        for k, (prompt_tokens, output_tokens, schema) in enumerate(cells):
            w = workload(prompt_tokens, output_tokens, schema)
            if (w.calibration or {}).get("note"):
                notes.add(w.calibration["note"])
            build = builder(w, f"p{prompt_tokens}-o{output_tokens}-{'schema' if schema else 'free'}")
            before = await loadgen.scrape_metrics(client, base_url)
            if args.rate is not None:
                load = {"mode": "rate", "rate_qps": args.rate, "arrival": "constant"}
                run = await loadgen.run_rate_point(
                    client,
                    chat_url,
                    build,
                    pool,
                    rate_qps=args.rate,
                    num_requests=args.requests_per_cell,
                    drain_timeout_s=args.drain_timeout,
                    schedule_seed=f"{args.seed}:{k}",
                )
            else:
                load = {"mode": "concurrency", "concurrency": args.concurrency}
                run = await loadgen.run_concurrency_point(
                    client,
                    chat_url,
                    build,
                    pool,
                    concurrency=args.concurrency,
                    num_requests=args.requests_per_cell,
                    drain_timeout_s=args.drain_timeout,
                )
            after = await loadgen.scrape_metrics(client, base_url)
            cell = {
                "prompt_tokens_target": prompt_tokens,
                "max_tokens": output_tokens,
                "schema": schema,
                **load,
            }
            point = report.summarize_point(run, cell, loadgen.server_stage_split(before, after))
            point["filler_words"] = w.filler_words
            point["schema_valid_fraction"] = schema_valid_fraction(run.results) if schema else None
            points.append(point)
            _progress(point)
            # after every cell, so that a run stopped by a time limit keeps the cells it measured
            write_grid(args.out, {"meta": {**meta, "complete": False}, "cells": points}, plots=False)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        await client.aclose()
    for note in sorted(notes):
        print(f"[grid] warning: {note}", file=sys.stderr)
    return {"meta": meta, "cells": points}


def schema_valid_fraction(results: list[loadgen.RequestResult]) -> float | None:
    """Share of completed answers that parse as JSON and validate against the extraction schema."""
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    try:
        import jsonschema
    except ImportError:  # a client-only box: parse and check the required keys only
        jsonschema = None
    valid = 0
    for r in ok:
        try:
            value = json.loads(r.text)
            if jsonschema is not None:
                jsonschema.validate(value, EXTRACTION_SCHEMA)
            elif not (isinstance(value, dict) and set(EXTRACTION_SCHEMA["required"]) <= set(value)):
                continue
            valid += 1
        except Exception:  # noqa: BLE001 - invalid JSON or a schema violation: not valid, whatever the reason
            continue
    return valid / len(ok)


def _progress(p: dict[str, Any]) -> None:
    valid = "" if p["schema_valid_fraction"] is None else f", schema-valid {p['schema_valid_fraction']:.0%}"
    print(
        f"[grid] prompt {p['prompt_tokens_target']} / out {p['max_tokens']} / "
        f"schema {'on' if p['schema'] else 'off'}: "
        f"{p['requests_completed']}/{p['requests_sent']} ok, TTFT p50 {ms(p['ttft_p50_s'])} ms, "
        f"E2E p95 {ms(p['e2e_p95_s'])} ms{valid}",
        file=sys.stderr,
        flush=True,
    )


def _meta(
    args: argparse.Namespace,
    *,
    model: str | None,
    target: str,
    http_client: str,
    label: str,
    calibration: dict | None,
    warmup_errors: int,
) -> dict[str, Any]:
    return {
        "label": label,
        "model": model,
        "target": target,
        "workload": {
            "name": "extraction",
            "seed": args.seed,
            "calibration": calibration,
            "schema": EXTRACTION_SCHEMA,
        },
        "grid": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "schema": args.schema,
            "requests_per_cell": args.requests_per_cell,
            "concurrency": None if args.rate is not None else args.concurrency,
            "rate_qps": args.rate,
        },
        "load": {
            "warmup": args.warmup,
            "warmup_errors": warmup_errors,
            "drain_timeout_s": args.drain_timeout,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "skip_special_tokens": args.skip_special_tokens or not args.ignore_eos,
            "extra_body": args.extra_body,
            "http_client": http_client,
        },
        **run_environment(args),
    }


# ---- files -------------------------------------------------------------------------------------------------
def markdown_grid(result: dict[str, Any]) -> str:
    meta, cells = result["meta"], result["cells"]
    load = (
        f"concurrency {meta['grid']['concurrency']}"
        if meta["grid"]["rate_qps"] is None
        else f"{meta['grid']['rate_qps']} QPS"
    )
    lines = [
        f"# g4serve bench grid: {meta['label']} — extraction, {load}, "
        f"{meta['grid']['requests_per_cell']} requests "
        "per cell",
        "",
        f"- model: `{meta.get('model')}`; target: {meta.get('target')}",
        (
            f"- device: {meta.get('device')}; torch {meta.get('torch_version')}; "
            f"python {meta.get('python_version')}"
        ),
        f"- git: `{meta.get('git_commit')}`; date: {meta.get('date')}",
        f"- load: `{json.dumps(meta['load'])}`; calibration: `{json.dumps(meta['workload']['calibration'])}`",
        f"- command: `{meta.get('command')}`",
        "",
        "| prompt (target) | max_tokens | schema | done/sent | err | prompt tok | out tok | "
        + " | ".join(h for _, h, _, _ in CELL_COLUMNS)
        + " | schema-valid |",
        "|---:|---:|---|---:|---:|---:|---:|" + "---:|" * len(CELL_COLUMNS) + "---:|",
    ]
    for c in cells:
        valid = "–" if c.get("schema_valid_fraction") is None else f"{c['schema_valid_fraction']:.0%}"
        values = " | ".join(report._fmt(c.get(k), scale, digits) for k, _, scale, digits in CELL_COLUMNS)
        lines.append(
            f"| {c['prompt_tokens_target']} | {c['max_tokens']} | {'on' if c['schema'] else 'off'} "
            f"| {c['requests_completed']}/{c['requests_sent']} | {c['errors']} "
            f"| {report._fmt(c['mean_prompt_tokens'], digits=0)} | {report._fmt(c['mean_output_tokens'])} "
            f"| {values} | {valid} |"
        )
    if any(c["schema"] for c in cells):
        lines += [
            "",
            "schema-valid: the share of completed answers that parse as JSON and validate against the "
            "schema; an answer that max_tokens cut before the object closed counts as invalid.",
        ]
    errors = [(c, e) for c in cells for e in c.get("first_errors", [])]
    if errors:
        lines += ["", "Errors (first messages):", ""]
        lines += [
            f"- prompt {c['prompt_tokens_target']} / out {c['max_tokens']} / schema {c['schema']}: {e}"
            for c, e in errors
        ]
    return "\n".join(lines) + "\n"


def plot_grid(out_dir: Path, result: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    outputs = sorted({c["max_tokens"] for c in cells})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []
    for filename, key, ylabel, scale in PLOTS:
        fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
        for i, out_tokens in enumerate(outputs):
            for schema in (False, True):
                xy = sorted(
                    (c["prompt_tokens_target"], c[key] * scale)
                    for c in cells
                    if c["max_tokens"] == out_tokens and c["schema"] == schema and c.get(key) is not None
                )
                if xy:
                    xs, ys = zip(*xy)
                    ax.plot(
                        xs,
                        ys,
                        marker="o",
                        color=colors[i % len(colors)],
                        linestyle="--" if schema else "-",
                        markerfacecolor="none" if schema else colors[i % len(colors)],
                        label=f"{out_tokens} out{', schema' if schema else ''}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c["prompt_tokens_target"] for c in cells}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("prompt tokens (target)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{result['meta']['label']}: extraction {ylabel}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        written.append(report.save_figure(fig, out_dir / filename))
    return written


def write_grid(out_dir: str | Path, result: dict[str, Any], *, plots: bool = True) -> dict[str, Path]:
    return report.write_outputs(
        out_dir,
        "grid",
        result,
        markdown_grid(result),
        (lambda out: plot_grid(out, result)) if plots else None,
    )
