"""Every environment variable g4serve reads, in one place: its name, default, allowed values and meaning.

Command-line flags configure a server or an engine (``engine/config.py``); these variables are the rest:
secrets, paths, and switches for kernels, which the benchmarks flip for A/B runs (a default follows what a
device run measured). Modules read them through ``get``, once at import unless said otherwise, so a
value set after ``import g4serve`` does not change a running process; an unknown name is a programming
error, and a value outside a variable's choices is refused with the variable's name. docs/api.md
("Environment variables") lists the same table; tests/test_envs.py keeps the two and the sources in step.
Only the standard library is imported here: every layer may read its switches, kernels included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None  # None: unset unless the environment sets it
    meaning: str
    choices: tuple[str, ...] = ()  # empty: any value (a number, a path, a secret)
    secret: bool = False  # never written into results (``recorded``)


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "G4SERVE_API_KEY", None, "the API key `serve` requires when `--api-key` is not given", secret=True
    ),
    Variable(
        "G4SERVE_CACHE",
        None,
        "where the embedded tiny model and the sample media are built (`~/.cache/g4serve`)",
    ),
    Variable(
        "G4SERVE_PDL",
        "1",
        "`0`: no programmatic dependent launch for decode-sized kernels (Hopper and later; A/B runs)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_SKINNY_MAX_ROWS",
        "64",
        "token rows up to which CUDA projections may take the skinny decode GEMM (`0`: cuBLAS only)",
    ),
    Variable(
        "G4SERVE_DECODE_TAIL",
        "0",
        "`1`: a dense layer's tail after attention (o_proj, norms, MLP, PLE) in one persistent launch at "
        "decode sizes (`kernels/decode_tail.py`; off: its first version was 2.3x slower than the separate "
        "launches on an H200)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_ENCODER_GRAPHS",
        "1",
        "`0`: the vision and audio encoders run eagerly on CUDA, not as captured CUDA graphs (A/B runs)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_STEP_STALL_S",
        "60",
        "`GET /health` answers 503 while the engine's current step has run longer than this many seconds (a "
        "stalled device; read at each check; `0`: never)",
    ),
    Variable(
        "G4SERVE_STEP_TIMEOUT_S",
        None,
        "a step that has run longer than this many seconds stops the engine: every open request ends with a "
        "503 ('engine is not running: a step ran past ...') instead of waiting on a device that stopped, and "
        "`GET /health` stays 503 (restart the server; `0`: never; unset: 300 on CUDA, never on the CPU, "
        "whose long prefills are slow, not stuck)",
    ),
    Variable(
        "G4SERVE_DECODE_EARLY_TABLE",
        "1",
        "`0`: paged decode attention loads the sequence lengths, its first tile's block-table entries and "
        "the KV scales after its dependent-launch wait, not before (`kernels/paged_decode.py`; A/B runs)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_NORM_EARLY_LOADS",
        "1",
        "`0`: the fused RMSNorm pass loads its weights, the residual and the layer scalar after its "
        "dependent-launch wait, not before (`kernels/rms_norm.py`; A/B runs)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_DECODE_PROGRAMS_PER_SM",
        "4",
        "paged decode attention splits a context over programs until about this many run per SM "
        "(`kernels/paged_decode.py`; `1`: a batch with a program per SM already, no split)",
    ),
    Variable(
        "G4SERVE_SORT_FREE_TOP_K",
        "0",
        "`1`: CUDA batches that use top-k sample in the sort-free kernel too (a radix select of the k-th "
        "best instead of `torch.topk`; off: slower than `torch.topk` on an H200)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_CHUNKED_SAMPLING",
        "1",
        "`1`: CUDA batches whose sampled rows set a top-k of at most 128 (top-p and min-p on top of it) or "
        "no top-k and no top-p sample over vocabulary chunks, many programs a row "
        "(`kernels/chunked_sample.py`; e4b decode with top-k 64 / top-p 0.95 0.13-0.21 ms a step faster on "
        "an H100); `0`: `torch.topk` and the one-program-a-row kernel",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_FP8_MATMUL",
        "w8a8",
        "FP8 weights with dynamic activation scales at decode sizes: `w8a8` on the FP8 tensor cores, "
        "`dequant` the in-register dequantizing kernel",
        ("w8a8", "dequant"),
    ),
    Variable(
        "G4SERVE_FP8_NORM_QUANT",
        "0",
        "`1`: a norm whose output feeds a W8A8 FP8 projection at decode sizes also quantizes it for that "
        "projection (one launch fewer each; off: no gain on an H200, slower on an H100: 31B FP8 13.52 "
        "against 13.40 ms a token at batch 1)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_FP8_ONE_ROW",
        "auto",
        "W8A8 FP8 projections of one token row: `fma` on the CUDA cores (many programs of a few weight "
        "rows), `mma` on the tensor cores' swapped 16-row tile, `auto` the CUDA cores for weights of at most "
        "2^25 elements (e4b's, not 31B's)",
        ("auto", "fma", "mma"),
    ),
    Variable(
        "G4SERVE_INT4_MATMUL",
        "auto",
        "int4 (w4a16) projections at decode sizes: `auto` (2-7 rows on tinygemm, one row and 8-16 rows on "
        "the Triton kernel: the faster of the two at each size on an H100), `tinygemm` (torch's "
        "`_weight_int4pack_mm`, the weights repacked at load beside the checkpoint's words) or `triton` "
        "(`kernels/quant_matmul.py`), up to 16 rows",
        ("auto", "triton", "tinygemm"),
    ),
    Variable(
        "G4SERVE_INT4_PLANES",
        "ptx",
        "how int4 tiles (`kernels/quant_matmul.py`, the int4 MoE experts) dequantize: `ptx` (nibble planes: "
        "the row tiles of up to 16 rows make them two words at a time on bf16x2 lanes, for bf16 activations "
        "and scales on CUDA, the same bits; one-row launches multiply them with x's planes, the scale once a "
        "word) or `fp32` (the kernels before: one plane at a time in fp32, whole tiles at one row; A/B runs)",
        ("ptx", "fp32"),
    ),
    Variable(
        "G4SERVE_QUANT_PREFILL",
        "triton",
        "quantized projections past 64 rows that neither `torch._scaled_mm` nor `G4SERVE_INT4_DENSE_ROWS` "
        "takes (FP8 with block scales): `triton` (the 2-D grid kernel) or `dequant` (the dense weight "
        "written by one launch, `kernels/dequant.py`, then cuBLAS)",
        ("triton", "dequant"),
    ),
    Variable(
        "G4SERVE_INT4_DENSE_ROWS",
        "17",
        "int4 (w4a16) projections on at least this many rows (decode batches past 16, and prefill) take the "
        "dense weight written by one launch (`kernels/dequant.py`), then cuBLAS; fewer rows take tinygemm or "
        "the Triton kernel",
    ),
    Variable(
        "G4SERVE_MOE_ALIGN",
        "parallel",
        "MoE assignments past 128 per step sorted by expert with the three-launch kernel (`parallel`) or "
        "torch's sort (`sort`); up to 128 one program does it",
        ("sort", "parallel"),
    ),
    Variable(
        "G4SERVE_MOE_GROUP_M",
        None,
        "MoE prefill GEMMs (past 32 rows per expert) take their tiles this many token blocks at a time "
        "through all N tiles (`0`: the 2-D grid, blocks fastest); unset: the measured orders (bf16's "
        "128-row tiles: 4 blocks for gate/up, 2 for down; the 64-row tiles: 0)",
    ),
    Variable(
        "G4SERVE_MOE_W8A8_MIN",
        "1",
        "FP8 experts at this many assignments or more multiply on the FP8 tensor cores (`0`: never)",
    ),
    Variable(
        "G4SERVE_MOE_W8A8_ROWS",
        "1",
        "FP8 experts with scales constant along K (per tensor / channel) quantize activations per token "
        "(`1`) or per 128-column group (`0`) for the FP8 tensor cores",
    ),
    Variable(
        "G4SERVE_TP_TIMEOUT_S", "1800", "seconds a tensor-parallel collective waits for a peer (a slow load)"
    ),
    Variable(
        "G4SERVE_TP_ONE_DEVICE",
        None,
        "`1`: every tensor-parallel rank on rank 0's GPU over gloo (tests on one GPU; not for serving)",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_GIL_SWITCH_INTERVAL_US",
        None,
        "microseconds a Python thread may hold the interpreter lock while another waits for it "
        "(`sys.setswitchinterval`), set when `AsyncLLMEngine` starts its thread; unset or empty: "
        "Python's 5,000",
    ),
    Variable(
        "G4SERVE_TORCH_PROFILER_DIR",
        None,
        "a directory: `serve` adds `POST /start_profile` and `POST /stop_profile`, which run torch.profiler "
        "on the engine thread and write a Chrome trace and an ops table there (`engine/torch_profile.py`)",
    ),
    Variable(
        "G4SERVE_TORCH_PROFILER_WITH_STACK",
        "1",
        "`1`: the profile records Python stacks, every Python call a trace event (`bench/trace_summary.py` "
        "sums them by function; slows the host several-fold while it runs); `0`: torch ops and kernels only",
        ("0", "1"),
    ),
    Variable(
        "G4SERVE_TORCH_PROFILER_MAX_S",
        "60",
        "seconds after which a profile started by `POST /start_profile` stops itself, its files written",
    ),
    Variable(
        "G4SERVE_GIT_COMMIT",
        None,
        "the commit benchmark results record, for a tree without its `.git` (the device machine's copy)",
    ),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str) -> str | None:
    """``name``'s value in the environment, else its default; refused with its name when it is not one of
    its choices."""
    var = _BY_NAME[name]
    value = os.environ.get(name, var.default)
    if var.choices and value is not None and value not in var.choices:
        raise ValueError(f"{name}: expected one of {', '.join(var.choices)}, got {value!r}")
    return value


def recorded() -> dict[str, str]:
    """Every variable's value in this process (set, or its default; unset ones left out), secrets left out:
    what a benchmark's JSON records, so an A/B run's two files say which side each is."""
    values = {v.name: os.environ.get(v.name, v.default) for v in VARIABLES if not v.secret}
    return {name: value for name, value in values.items() if value is not None}


def get_int(name: str) -> int:
    value = get(name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


def get_float(name: str) -> float:
    value = get(name)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None


__all__ = ["VARIABLES", "Variable", "get", "get_float", "get_int"]
