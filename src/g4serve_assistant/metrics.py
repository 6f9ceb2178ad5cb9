"""Prometheus metrics of the assistant: per-stage latency histograms, turns by intent and path, refusals.

Each app owns its ``CollectorRegistry`` (no global state), so tests can build several apps in one process.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# Stages run from well under a millisecond (normalization) to seconds (CPU LLM calls).
_STAGE_BUCKETS_S = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
)


class AssistantMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.stage = Histogram(
            "g4serve_assistant_stage_seconds",
            "Time spent in each pipeline stage",
            ["stage", "path"],
            buckets=_STAGE_BUCKETS_S,
            registry=r,
        )
        self.turns = Counter(
            "g4serve_assistant_turns", "Assistant turns by intent and path", ["intent", "path"], registry=r
        )
        self.refusals = Counter(
            "g4serve_assistant_refusals", "Actions the policy refused, by reason", ["reason"], registry=r
        )
        self.executed = Counter(
            "g4serve_assistant_actions_executed", "Confirmed actions executed", ["intent"], registry=r
        )
        self.llm_failures = Counter(
            "g4serve_assistant_llm_failures",
            "Gemma extractions that did not validate (answered with a clarifying question)",
            registry=r,
        )
        self.qna = Counter(
            "g4serve_assistant_qna_answers", "QnA answers by path (gemma or extractive)", ["path"], registry=r
        )
        self.errors = Counter(
            "g4serve_assistant_errors", "Requests refused with an HTTP error", ["status"], registry=r
        )

    def observe_turn(
        self,
        intent: str,
        path: str,
        stages_ms: Mapping[str, float],
        executed: bool,
        refused: str | None,
        llm_failed: bool = False,
    ) -> None:
        for stage, ms in stages_ms.items():
            self.stage.labels(stage=stage, path=path).observe(ms / 1000.0)
        self.turns.labels(intent=intent, path=path).inc()
        if executed:
            self.executed.labels(intent=intent).inc()
        if refused:
            self.refusals.labels(reason=refused).inc()
        if llm_failed:
            self.llm_failures.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
