#!/usr/bin/env bash
# Where a decode step's device time goes, in one device call: for each PRESET:VARIANT:BATCH of RUNS (default
# "31b:fp8+fp8kv:1 e4b:bf16:64"), bench/spec_decode.py times the step (ITL p50 against the format's bandwidth
# floor) and profiles PROFILE_STEPS steps under torch.profiler (the kernel table, a Chrome trace). Then, when
# set, the kernel benches beside it: GEMV_PRESET (bench/gemv_kernels.py --sweep at GEMV_ROWS, default "8 16"),
# GEMV_RUNS (PRESET:ROWS[:sweep] each, ROWS comma-separated: bench/gemv_kernels.py at those rows, the sweep
# compiled on 14 processes where named) and MOE_QUANT (bench/moe_kernels.py --quant MOE_QUANT --groups
# MOE_GROUPS at MOE_TOKENS: the quantized experts' block in each tile order) and TAIL_ARGS
# (bench/decode_tail.py TAIL_ARGS: the persistent decode tail against the separate launches; with BASE_SRC, an
# untracked older src/ from `git archive <rev> src | tar -x -C .ab-base` (carried), the same on those sources
# first) and, with TAIL_ENGINE=1, e4b decode (bench/engine_microbench.py, B = TAIL_BATCHES, default 1,8) with
# the tail off and on (G4SERVE_DECODE_TAIL). GPU_TESTS (paths; -k GPU_TESTS_K) run first. RUNS= skips the
# spec_decode.py runs; PROMPT_LEN (default 128) sets their prompts' length (the context each decode step reads).
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/decode_profile.sh", carry=[".whl"])
# Results: $OUT/decode_profile.tgz (JSON, traces, logs); the logs' tails in $OUT/summary.md.
set -uo pipefail
RUNS=${RUNS-31b:fp8+fp8kv:1 e4b:bf16:64} PROFILE_STEPS=${PROFILE_STEPS:-8} STEPS=${STEPS:-24} PROMPT_LEN=${PROMPT_LEN:-128}
GEMV_PRESET=${GEMV_PRESET:-} GEMV_ROWS=${GEMV_ROWS:-8 16} GEMV_RUNS=${GEMV_RUNS:-}
GPU_TESTS=${GPU_TESTS:-} GPU_TESTS_K=${GPU_TESTS_K:-}
TAIL_ARGS=${TAIL_ARGS:-} BASE_SRC=${BASE_SRC:-} TAIL_ENGINE=${TAIL_ENGINE:-0}
MOE_QUANT=${MOE_QUANT:-} MOE_GROUPS=${MOE_GROUPS:-0 2 4} MOE_TOKENS=${MOE_TOKENS:-1024 4096} OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-decode-profile}  # (under $OUT: the logs come back even if the call is cut)
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
gpu_tests
if [ -n "$TAIL_ARGS" ]; then
  # shellcheck disable=SC2086  # TAIL_ARGS: several words
  [ -n "$BASE_SRC" ] && PYTHONPATH="$BASE_SRC:$PYTHONPATH" run decode-tail-base "${TAIL_TIMEOUT:-150}" \
    python3 bench/decode_tail.py $TAIL_ARGS --out-dir "$RES/tail-base"
  # shellcheck disable=SC2086
  run decode-tail "${TAIL_TIMEOUT:-150}" python3 bench/decode_tail.py $TAIL_ARGS --out-dir "$RES/tail"
fi
if [ "$TAIL_ENGINE" = 1 ]; then
  for on in 0 1; do
    G4SERVE_DECODE_TAIL=$on run "decode-tail-e4b-$on" "${TAIL_ENGINE_TIMEOUT:-100}" python3 \
      bench/engine_microbench.py --model e4b --device cuda --attention-backend triton \
      --batches "${TAIL_BATCHES:-1,8}" --decode-steps 16 --prefill-lengths 512 --prefill-reps 1 \
      --out "$RES/decode-tail-$on" --tag="-tail$on"
  done
fi
for spec in $RUNS; do
  IFS=: read -r preset variant batch <<< "$spec"
  run "$preset-$variant-b$batch" "${RUN_TIMEOUT:-180}" python3 bench/spec_decode.py --model "$preset" \
    --device cuda --variants "$variant" --batches "$batch" --steps "$STEPS" --prefill-len 0 --prompt-len "$PROMPT_LEN" \
    --profile "$PROFILE_STEPS" --tag="-b$batch" --out "$RES/$preset-$variant-b$batch"
done
if [ -n "$GEMV_PRESET" ]; then
  # shellcheck disable=SC2086  # GEMV_ROWS: several words
  run "gemv-$GEMV_PRESET" "${GEMV_TIMEOUT:-240}" python3 bench/gemv_kernels.py --preset "$GEMV_PRESET" \
    --rows $GEMV_ROWS --sweep --out-dir "$RES/gemv"
fi
for spec in $GEMV_RUNS; do
  IFS=: read -r preset rows sweep <<< "$spec"
  # shellcheck disable=SC2046  # the rows: several words
  run "gemv-$preset-${rows//,/-}" "${GEMV_TIMEOUT:-240}" python3 bench/gemv_kernels.py --preset "$preset" \
    --rows $(tr , ' ' <<< "$rows") ${sweep:+--sweep --compile-workers 14} --out-dir "$RES/gemv"
done
if [ -n "$MOE_QUANT" ]; then
  # shellcheck disable=SC2086  # MOE_TOKENS, MOE_GROUPS: several words
  run "moe-$MOE_QUANT" "${MOE_TIMEOUT:-180}" python3 bench/moe_kernels.py --tokens $MOE_TOKENS \
    --quant "$MOE_QUANT" --groups $MOE_GROUPS --out-dir "$RES/moe"
fi
pack decode_profile 40
