"""``g4serve bench``: seeded synthetic workloads, an open-loop / closed-loop load generator for any
OpenAI-compatible server (or the engine directly), and reports with plots and comparisons.

``workloads`` builds the requests, ``loadgen`` sends them and times every streamed chunk, ``report``
turns per-request timings into per-point metrics, tables and plots, ``cli`` wires it to ``g4serve bench``.
"""

from g4serve.bench.workloads import WORKLOADS, BenchRequest, Workload, make_workload

__all__ = ["WORKLOADS", "BenchRequest", "Workload", "make_workload"]
