#!/usr/bin/env bash
# Decode A/B over environment settings in one device call: bench/spec_decode.py (decode ITL against each
# format's bandwidth floor; with PROFILE_STEPS > 0 also the kernels' share of the step's timeline) for each
# PRESET:VARIANT of RUNS (default "31b:fp8+fp8kv e4b:fp8 e4b:bf16") at BATCHES (default 1,8), once per
# setting of SETTINGS: space-separated NAME=VAR=VALUE[,VAR=VALUE...] (NAME alone: the defaults), in the order
# given, e.g. SETTINGS="base nq=G4SERVE_FP8_NORM_QUANT=1 base". GPU_TESTS (paths; -k GPU_TESTS_K) run first.
#   run(command="G4SERVE_GIT_COMMIT=<sha> SETTINGS='...' bash bench/device/env_ab.sh", carry=[".whl"])
# Results: $OUT/env_ab.tgz (JSON, traces, logs); the logs' tails in $OUT/summary.md. The logs are written under
# $OUT/r as they finish, so a call cut by its time limit still brings back the runs done (at most 8 files).
# PRESET may be a checkpoint's path (its folder's name tags the run); PROMPT_LEN sets the decoded requests'
# prompt (spec_decode.py's --prompt-len). Exits 1 when a run failed.
set -uo pipefail
RUNS=${RUNS:-31b:fp8+fp8kv e4b:fp8 e4b:bf16} SETTINGS=${SETTINGS:-base} BATCHES=${BATCHES:-1,8}
STEPS=${STEPS:-24} PROFILE_STEPS=${PROFILE_STEPS:-0} GPU_TESTS=${GPU_TESTS:-} GPU_TESTS_K=${GPU_TESTS_K:-}
OUT=${OUT:-/tmp/out}
RES=${RES:-$OUT/r}
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
gpu_tests
for spec in $RUNS; do
  IFS=: read -r preset variant <<< "$spec"
  i=0
  for setting in $SETTINGS; do
    i=$((i + 1))
    name=${setting%%=*} assignments=()
    [ "$setting" != "$name" ] && IFS=, read -r -a assignments <<< "${setting#*=}"
    tag="$(basename "$preset")-${variant//[^A-Za-z0-9.]/-}-$i-$name"
    extra=()
    [ "$PROFILE_STEPS" -gt 0 ] && extra=(--profile "$PROFILE_STEPS")
    [ -n "${PROMPT_LEN:-}" ] && extra+=(--prompt-len "$PROMPT_LEN")
    (
      for a in "${assignments[@]}"; do export "${a?}"; done
      run "$tag" "${RUN_TIMEOUT:-150}" python3 bench/spec_decode.py --model "$preset" --device "${DEVICE:-cuda}" \
        --variants "$variant" --batches "$BATCHES" --steps "$STEPS" --prefill-len 0 "${extra[@]}" \
        --tag="-$i-$name" --out "$RES/$tag"
    )
  done
done
pack env_ab 24
# exit 1 when any run failed (every run still ran, and its log is packed)
! grep -l "^exit [1-9]" "$RES"/*.log
