"""Capacity model: tokens/s and concurrent streams or voice calls per GPU from this repo's measured step
times (bench/capacity_inputs.json), and the replicas a target load needs. Every output says whether it is
measured, derived (arithmetic on measured figures at the measured operating point) or extrapolated.

    python bench/capacity.py                      # the tables of docs/scaling.md
    python bench/capacity.py --target-calls 2500 --turn-interval-s 6
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

INPUTS = Path(__file__).with_name("capacity_inputs.json")


@dataclass(frozen=True)
class Model:
    name: str
    decode_itl_ms: dict[int, float]  # decode step time (= time per output token of each request) by batch
    prefill_ttft_ms: dict[int, float]  # one prompt of that many tokens, submission to first token


@dataclass(frozen=True)
class VoiceCapacity:
    batch: int | None  # extraction calls in flight per replica; None: the SLO is missed even at batch 1
    extraction_p50_ms: float
    extraction_p95_ms: float
    llm_calls_per_s: float
    concurrent_calls: float  # voice calls one replica carries at the planned utilization


def load_inputs(path: Path = INPUTS) -> dict:
    return json.loads(path.read_text())


def models_from(inputs: dict) -> list[Model]:
    def by_int(table: dict) -> dict[int, float]:
        return {int(k): float(v) for k, v in sorted(table.items(), key=lambda kv: int(kv[0]))}

    return [
        Model(name, by_int(m["decode_itl_ms"]), by_int(m["prefill_ttft_ms"]))
        for name, m in inputs["models"].items()
    ]


def decode_tokens_per_s(batch: int, itl_ms: float) -> float:
    """Output tokens per second of a replica decoding ``batch`` requests at ``itl_ms`` a step."""
    return batch * 1000.0 / itl_ms


def prefill_tokens_per_s(prompt_tokens: int, ttft_ms: float) -> float:
    return prompt_tokens * 1000.0 / ttft_ms


def largest_batch_within(itl_ms: dict[int, float], limit_ms: float, scale: float = 1.0) -> int | None:
    """The largest *measured* batch whose step time times ``scale`` stays within ``limit_ms``: batches beyond
    the measured ones are never assumed."""
    fitting = [batch for batch, ms in itl_ms.items() if ms * scale <= limit_ms]
    return max(fitting) if fitting else None


def replicas_for(load: float, per_replica: float, spare: int = 0) -> int:
    """Replicas that carry ``load`` at ``per_replica`` each (already derated), plus ``spare``."""
    if per_replica <= 0:
        raise ValueError("a replica that carries nothing cannot serve any load")
    return math.ceil(load / per_replica - 1e-9) + spare


def voice_capacity(
    model: Model,
    reference: Model,
    p50_ms: float,
    p95_ms: float,
    slo_p95_ms: float,
    llm_share: float,
    turn_interval_s: float,
    utilization: float,
) -> VoiceCapacity:
    """Voice calls one engine replica carries, bounded by the extraction call's latency SLO.

    The extraction call was measured alone (batch 1) on ``reference``. A call is a few engine steps (one per
    decoded token, the forced JSON riding along), so at batch B on ``model`` it is taken to last its measured
    time times step(B on model) / step(1 on reference). The replica keeps the largest measured B whose p95
    stays within the SLO, and by Little's law finishes B / p50(B) calls a second; only ``llm_share`` of the
    utterances reach the model, and each call speaks one every ``turn_interval_s``."""
    reference_step_ms = reference.decode_itl_ms[1]
    batch = largest_batch_within(model.decode_itl_ms, slo_p95_ms, p95_ms / reference_step_ms)
    step_ms = (
        model.decode_itl_ms[batch] if batch is not None else model.decode_itl_ms[min(model.decode_itl_ms)]
    )
    call_p50_ms = p50_ms * step_ms / reference_step_ms
    call_p95_ms = p95_ms * step_ms / reference_step_ms
    if batch is None:
        return VoiceCapacity(None, call_p50_ms, call_p95_ms, 0.0, 0.0)
    llm_calls_per_s = batch * 1000.0 / call_p50_ms
    utterances_per_s = llm_calls_per_s / llm_share
    return VoiceCapacity(
        batch, call_p50_ms, call_p95_ms, llm_calls_per_s, utterances_per_s * turn_interval_s * utilization
    )


def calls_per_audio_thread(ms_per_utterance: float, turn_interval_s: float, utilization: float) -> float:
    """Voice calls one assistant process carries: its one audio thread decodes, end-points and transcribes
    every utterance, one after another."""
    return 1000.0 / ms_per_utterance * turn_interval_s * utilization


# --- report ------------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def streaming_report(inputs: dict, models: list[Model]) -> str:
    slo = inputs["streaming"]["itl_slo_ms"]["value"]
    target = inputs["streaming"]["target_concurrent_streams"]["value"]
    utilization = inputs["planning"]["utilization"]["value"]
    spare = inputs["planning"]["spare_replicas"]["value"]
    rows = []
    for m in models:
        batches = " / ".join(str(b) for b in m.decode_itl_ms)
        itl = " / ".join(f"{ms:.2f}" for ms in m.decode_itl_ms.values())
        tok_s = " / ".join(f"{decode_tokens_per_s(b, ms):,.0f}" for b, ms in m.decode_itl_ms.items())
        prompt = max(m.prefill_ttft_ms)
        prefill = prefill_tokens_per_s(prompt, m.prefill_ttft_ms[prompt])
        streams = largest_batch_within(m.decode_itl_ms, slo)
        replicas = replicas_for(target, streams * utilization, spare) if streams else "–"
        rows.append(
            [m.name, batches, itl, tok_s, f"{prefill:,.0f} ({prompt})", str(streams), f"{replicas:,}"]
        )
    header = [
        "model (1 GPU)",
        "batch",
        "ITL ms (measured)",
        "decode tok/s (derived: B x 1000 / ITL)",
        "prefill tok/s (derived; prompt tokens)",
        f"streams per GPU at ITL <= {slo} ms (largest measured batch)",
        f"replicas for {target:,} streams (extrapolated)",
    ]
    return _table(header, rows)


def voice_report(inputs: dict, models: list[Model], turn_interval_s: float, target_calls: int) -> str:
    voice = inputs["voice_call"]
    plan = inputs["planning"]
    utilization, spare = plan["utilization"]["value"], plan["spare_replicas"]["value"]
    reference = next(m for m in models if m.name == voice["reference_model"])
    slo_ms = voice["latency_slo_p95_ms"]["value"]
    audio_ms = voice["audio_thread_ms_per_utterance"]["value"]
    asr_calls = calls_per_audio_thread(audio_ms, turn_interval_s, utilization)
    processes = replicas_for(target_calls, asr_calls, spare)
    rows = []
    for m in models:
        cap = voice_capacity(
            m,
            reference,
            voice["extraction_latency_ms"]["p50"],
            voice["extraction_latency_ms"]["p95"],
            voice["latency_slo_p95_ms"]["value"],
            voice["llm_share"]["value"],
            turn_interval_s,
            utilization,
        )
        kind = "measured (batch 1)" if m is reference and cap.batch == 1 else "extrapolated"
        gpus = replicas_for(target_calls, cap.concurrent_calls, spare) if cap.batch else None
        rows.append(
            [
                m.name,
                str(cap.batch or "–"),
                f"{cap.extraction_p50_ms:.1f} / {cap.extraction_p95_ms:.1f} ({kind})",
                f"{cap.llm_calls_per_s:,.0f}",
                f"{cap.concurrent_calls:,.0f}",
                f"{gpus:,}" if gpus else "SLO missed",
                # Each assistant process holds its own engine (one GPU) and one audio thread.
                f"{max(processes, gpus):,}" if gpus else "–",
            ]
        )
    header = [
        "model (1 GPU)",
        f"extraction calls in flight (largest measured batch, p95 <= {slo_ms} ms)",
        "extraction p50 / p95 ms at that batch",
        "extraction calls/s per GPU (extrapolated)",
        "voice calls per GPU (extrapolated)",
        f"GPUs for {target_calls:,} calls if the assistant used engines behind the router "
        "(not built; extrapolated)",
        "GPUs today: an engine in each assistant process (extrapolated)",
    ]
    summary = (
        f"Assistant tier: one audio thread per process carries {asr_calls:,.1f} calls "
        f"(1000 / {audio_ms} ms x {turn_interval_s:g} s x {utilization}: "
        f"extrapolated), so {target_calls:,} calls need {processes:,} assistant processes "
        f"(incl. {spare} spare)."
    )
    return _table(header, rows) + "\n\n" + summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, default=INPUTS)
    parser.add_argument(
        "--turn-interval-s", type=float, default=None, help="seconds between a caller's utterances"
    )
    parser.add_argument("--target-calls", type=int, default=None, help="concurrent voice calls to plan for")
    args = parser.parse_args(argv)
    inputs = load_inputs(args.inputs)
    models = models_from(inputs)
    voice = inputs["voice_call"]
    interval = args.turn_interval_s or voice["turn_interval_s"]["value"]
    target = args.target_calls or voice["target_concurrent_calls"]["value"]
    print(f"# Capacity per GPU ({inputs['device']})\n")
    print(streaming_report(inputs, models))
    print(f"\n# Voice calls: {target:,} concurrent, one utterance every {interval:g} s\n")
    print(voice_report(inputs, models, interval, target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
