#!/usr/bin/env bash
# Decode (and TTFT) A/B in one device call: bench/spec_decode.py (decode ITL at BATCHES against each format's
# bandwidth floor) on this tree ("now") and on the sources in BASE_SRC ("base": an older src/,
# `git archive <rev> src | tar -x -C .ab-base`, carried), in the order of ORDER (default "now base now": the
# machine's drift shows as the two "now" rows), for each PRESET:VARIANTS[:PREFILL] of RUNS (default
# "31b:fp8+fp8kv e4b:fp8"; PREFILL: also the TTFT of a prompt of that many tokens, the best of PREFILL_REPS).
# First, the GPU tests GPU_TESTS (default tests/gpu/test_quant_gpu.py) with -k GPU_TESTS_K (default: the W8A8
# ones); GPU_TESTS= skips them.
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/fp8_ab.sh", carry=[".whl", ".ab-base"])
# Results: $OUT/fp8_ab.tgz (JSON and logs); the logs' tails in $OUT/summary.md.
set -uo pipefail
RUNS=${RUNS:-31b:fp8+fp8kv e4b:fp8} ORDER=${ORDER:-now base now} BATCHES=${BATCHES:-1,8} STEPS=${STEPS:-24}
GPU_TESTS=${GPU_TESTS-tests/gpu/test_quant_gpu.py} GPU_TESTS_K=${GPU_TESTS_K:-fp8_matmul or w8a8}
BASE_SRC=${BASE_SRC:-.ab-base/src} PREFILL_REPS=${PREFILL_REPS:-3} OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-fp8-ab}  # (under $OUT: the logs come back even if the call is cut)
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
gpu_tests
for spec in $RUNS; do
  IFS=: read -r preset variants prefill <<< "$spec"
  name=$preset-${variants//[^A-Za-z0-9.]/-} i=0
  for side in $ORDER; do
    i=$((i + 1))
    path=$PYTHONPATH
    [ "$side" = base ] && path=$PWD/$BASE_SRC:$PYTHONPATH
    PYTHONPATH=$path run "$name-$i-$side" "${RUN_TIMEOUT:-150}" python3 bench/spec_decode.py --model "$preset" \
      --device cuda --variants "$variants" --batches "$BATCHES" --steps "$STEPS" --prefill-len "${prefill:-0}" \
      --prefill-reps "$PREFILL_REPS" \
      --tag="-$i-$side" --out "$RES/$name-$i-$side"
  done
done
pack fp8_ab 30
