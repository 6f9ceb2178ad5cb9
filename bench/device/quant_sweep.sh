#!/usr/bin/env bash
# Tiles of the quantized-weight GEMM (kernels/quant_matmul.py) on the device, in one call: bench/gemv_kernels.py
# --quant KIND --sweep for each of KINDS (default fp8 w4a16) on each of PRESETS (default e4b 31b) at ROWS
# (default 1 2 4 8): every decode projection shape timed with quant_matmul's default tiles, the bf16 cuBLAS and
# skinny kernels beside it, then the sweep's grid (M=1: ~45 FMA-path tiles; 2..8 rows: 42 tensor-core tiles
# at the lead row count 8, its 6 best at 2 and 4; split-K where a tile leaves SMs idle). Each run first
# compiles its kernels in COMPILE_WORKERS processes (Triton's disk cache, which the later runs reuse).
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/quant_sweep.sh", carry=[".whl"],
#       timeout_s=420)
# About 3-4 min on an H100 (wheels ~15 s; e4b fp8 ~60 s and w4a16 ~70 s, mostly compiling ~700 kernels on 12
# processes; 31b ~30 s each, its kernels mostly cached). A run may take RUN_MAX s (default 130) of the time
# left before DEADLINE (default 300 s), less 25 s for each run after it; one cut short keeps the shapes it
# finished in its JSON ("complete": false). SETUP=0 skips the wheels (the sweep needs torch and triton only).
# Everything lands in $OUT/quant_sweep.tgz (the JSON of each run: every trial, the best tiles per (preset,
# row tile, N, K), also as the python dict QUANT_MATMUL_CONFIGS); the logs (tables, per-step sums, the dicts)
# are in $OUT/summary.md.
set -uo pipefail
PRESETS=${PRESETS:-e4b 31b} KINDS=${KINDS:-fp8 w4a16} ROWS=${ROWS:-1 2 4 8} OUT=${OUT:-/tmp/out}
COMPILE_WORKERS=${COMPILE_WORKERS:-12} DEADLINE=${DEADLINE:-300} RUN_MAX=${RUN_MAX:-130}
SWEEP_ARGS=${SWEEP_ARGS:-}
RES=/tmp/res-quant-sweep
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-quant-sweep}
read -r -a presets <<< "$PRESETS"
read -r -a kinds <<< "$KINDS"
read -r -a rows <<< "$ROWS"
left=$(( ${#presets[@]} * ${#kinds[@]} ))
for preset in "${presets[@]}"; do
  for kind in "${kinds[@]}"; do
    left=$((left - 1))
    share=$((DEADLINE - SECONDS - 25 * left))
    [ "$share" -gt "$RUN_MAX" ] && share=$RUN_MAX
    if [ "$share" -lt 20 ]; then
      echo "== sweep-$preset-$kind skipped: ${share} s left for it" | tee "$RES/sweep-$preset-$kind.log"
      continue
    fi
    # shellcheck disable=SC2086  # SWEEP_ARGS: extra flags, split on spaces
    TAIL_LINES=${TAIL_LINES:-8} run "sweep-$preset-$kind" "$share" python3 bench/gemv_kernels.py \
      --preset "$preset" --quant "$kind" --rows "${rows[@]}" --sweep --compile-workers "$COMPILE_WORKERS" \
      --calls-per-graph 16 --graph-replays 5 --out-dir "$RES" $SWEEP_ARGS
  done
done
{
  echo "# quant_matmul tile sweep: PRESETS=$PRESETS KINDS=$KINDS ROWS=$ROWS ($SECONDS s)"
  for preset in "${presets[@]}"; do
    for kind in "${kinds[@]}"; do
      f="$RES/sweep-$preset-$kind.log"
      echo "## $(basename "$f")"
      echo '```'
      grep -v '^    {' "$f"  # per-config compile errors left out: they are in the run's JSON
      echo '```'
    done
  done
} > "$OUT/summary.md"
tar -czf "$OUT/quant_sweep.tgz" -C "$RES" .
