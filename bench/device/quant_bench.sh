#!/usr/bin/env bash
# Quantized weights on the device, in one call per model: the quantization GPU tests (RUN_GPU_TESTS=1), then the
# engine microbenchmark (decode ITL at BATCHES, TTFT, the decode bandwidth floor of each format's bytes) for
# each of FORMATS on PRESET: bf16 (no quantization), fp8, fp8-block, w4a16, w4a16-g32. PREFILL_AB=1 adds the
# w4a16 run with G4SERVE_QUANT_PREFILL=dequant (dequantize + cuBLAS past 64 rows instead of the Triton grid).
#   run(command="PRESET=e4b G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/quant_bench.sh", carry=[".whl"])
#   run(command="PRESET=31b RUN_GPU_TESTS=0 bash bench/device/quant_bench.sh", carry=[".whl"])   # also 26b-a4b
# Everything lands in $OUT/quant_bench.tgz; the logs' tails are in $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} RUN_GPU_TESTS=${RUN_GPU_TESTS:-1} PREFILL_AB=${PREFILL_AB:-0}
FORMATS=${FORMATS:-bf16 fp8 fp8-block w4a16 w4a16-g32} BATCHES=${BATCHES:-1,8,32,64} OUT=${OUT:-/tmp/out}
RES=/tmp/res-quant
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
if [ "$RUN_GPU_TESTS" = 1 ]; then
  run gpu_tests "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -s -m gpu tests/gpu/test_quant_gpu.py -p no:cacheprovider
fi
microbench() {  # microbench FORMAT [TAG]
  local fmt=$1 tag=${2:-}
  local flag=()
  [ "$fmt" != bf16 ] && flag=(--quantization "$fmt")
  run "microbench-$PRESET-$fmt$tag" "${MICROBENCH_TIMEOUT:-200}" python3 bench/engine_microbench.py --model "$PRESET" \
    --device cuda --attention-backend triton "${flag[@]}" --batches "$BATCHES" --decode-steps 16 \
    --prefill-lengths 128,512,2048 --prefill-reps 3 --out "$RES" --tag="$tag"
}
for fmt in $FORMATS; do microbench "$fmt"; done
if [ "$PREFILL_AB" = 1 ]; then
  G4SERVE_QUANT_PREFILL=dequant microbench w4a16 -dequant-prefill
fi
{
  for f in "$RES"/*.log; do echo "## $(basename "$f")"; echo '```'; tail -n 30 "$f"; echo '```'; done
} > "$OUT/summary.md"
tar -czf "$OUT/quant_bench.tgz" -C "$RES" .
