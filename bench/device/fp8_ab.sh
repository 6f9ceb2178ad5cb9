#!/usr/bin/env bash
# FP8 decode A/B in one device call: bench/spec_decode.py (decode ITL at BATCHES against each format's
# bandwidth floor, no TTFT) on this tree ("now") and on the sources in BASE_SRC ("base": an older src/,
# `git archive <rev> src | tar -x -C .ab-base`, carried), in the order of ORDER (default "now base now": the
# machine's drift shows as the two "now" rows), for each PRESET:VARIANTS of RUNS (default "31b:fp8+fp8kv
# e4b:fp8"). GPU_TESTS_K: first, that -k expression of tests/gpu/test_quant_gpu.py (default: the W8A8 ones).
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/fp8_ab.sh", carry=[".whl", ".ab-base"])
# Results: $OUT/fp8_ab.tgz (JSON and logs); the logs' tails in $OUT/summary.md.
set -uo pipefail
RUNS=${RUNS:-31b:fp8+fp8kv e4b:fp8} ORDER=${ORDER:-now base now} BATCHES=${BATCHES:-1,8} STEPS=${STEPS:-24}
GPU_TESTS_K=${GPU_TESTS_K:-fp8_matmul or w8a8} BASE_SRC=${BASE_SRC:-.ab-base/src} OUT=${OUT:-/tmp/out}
RES=/tmp/res-fp8-ab
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -n "$GPU_TESTS_K" ] && run gpu-tests 120 python3 -m pytest -q -m gpu tests/gpu/test_quant_gpu.py -k "$GPU_TESTS_K"
for spec in $RUNS; do
  preset=${spec%%:*} variants=${spec#*:} i=0
  for side in $ORDER; do
    i=$((i + 1))
    path=$PYTHONPATH
    [ "$side" = base ] && path=$PWD/$BASE_SRC:$PYTHONPATH
    PYTHONPATH=$path run "$preset-$i-$side" "${RUN_TIMEOUT:-150}" python3 bench/spec_decode.py --model "$preset" \
      --device cuda --variants "$variants" --batches "$BATCHES" --steps "$STEPS" --prefill-len 0 \
      --tag="-$i-$side" --out "$RES/$preset-$i-$side"
  done
done
{
  for f in "$RES"/*.log; do echo "## $(basename "$f")"; echo '```'; tail -n 30 "$f"; echo '```'; done
} > "$OUT/summary.md"
tar -czf "$OUT/fp8_ab.tgz" -C "$RES" .
