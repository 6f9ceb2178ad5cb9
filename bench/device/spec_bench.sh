#!/usr/bin/env bash
# Speculative decoding and serving formats on the device, one call per model: the speculative GPU tests
# (RUN_GPU_TESTS=1), then bench/spec_decode.py over VARIANTS on PRESET (decode ITL and tokens/s at BATCHES,
# TTFT, each variant's bandwidth floor), one JSON and one markdown table.
#   run(command="PRESET=e4b G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/spec_bench.sh", carry=[".whl-gpu"])
#   run(command="PRESET=31b RUN_GPU_TESTS=0 BATCHES=1,8,32 VARIANTS=fp8,fp8+fp8kv EXTRA_ARGS='--fit 32x8192' \
#       bash bench/device/spec_bench.sh", carry=[".whl-gpu"])
# EXTRA_ARGS go to spec_decode.py (--profile 8, --fit 32x8192, ...). Everything lands in
# $OUT/spec_bench-$PRESET.tgz; the logs' tails are in $OUT/summary-$PRESET.md (one call may run several presets).
set -uo pipefail
PRESET=${PRESET:-e4b} RUN_GPU_TESTS=${RUN_GPU_TESTS:-1} BATCHES=${BATCHES:-1,8,32,64}
VARIANTS=${VARIANTS:-bf16,mtp@1.0,mtp@0.7} OUT=${OUT:-/tmp/out}
RES=/tmp/res-spec-$PRESET
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
if [ "$RUN_GPU_TESTS" = 1 ]; then
  run "gpu_tests-$PRESET" "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -q -s -m gpu tests/gpu/test_speculative_gpu.py \
    -p no:cacheprovider
fi
run "spec-decode-$PRESET" "${BENCH_TIMEOUT:-480}" python3 bench/spec_decode.py --model "$PRESET" --device cuda \
  --variants "$VARIANTS" --batches "$BATCHES" ${EXTRA_ARGS:-} --out "$RES"
{
  for f in "$RES"/*.log; do echo "## $(basename "$f")"; echo '```'; tail -n 40 "$f"; echo '```'; done
} > "$OUT/summary-$PRESET.md"
tar -czf "$OUT/spec_bench-$PRESET.tgz" -C "$RES" .
