#!/usr/bin/env bash
# Every serving format of issue 22 in one device call and one table: bench/spec_decode.py once per model
# (RUNS: "MODEL|VARIANTS|BATCHES" separated by spaces), each under its share of DEADLINE seconds, then
# `spec_decode.py --merge` over the JSON they wrote.
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/formats_table.sh", carry=[".whl-gpu"],
#       timeout_s=600)
# Defaults: e4b bf16 / fp8 / w4a16 / bf16 + FP8 KV / MTP at forced 1.0 and 0.7 at B = 1, 8, 32, 64; 26b-a4b bf16 /
# fp8 / w4a16 / fp8 + MTP 1.0; 31b fp8 + FP8 KV, with MTP 1.0, at B = 1, 8, 32 (31B in bf16 does not fit one
# H100 with KV room). STEPS decode steps per batch (default 16), TTFT over PREFILL_REPS (default 2) 2,048-token
# prompts. A run cut short by its share leaves the runs before it; the merged table and every JSON land in
# $OUT/formats_table.tgz, the table also in $OUT/formats-table.md. SETUP=0 (a CPU smoke test, DEVICE=cpu) skips
# the wheels.
set -uo pipefail
DEFAULT_RUNS="e4b|bf16,fp8,w4a16,fp8kv,mtp@1.0,mtp@0.7|1,8,32,64 26b-a4b|bf16,fp8,w4a16,fp8+mtp@1.0|1,8,32,64"
DEFAULT_RUNS+=" 31b|fp8+fp8kv,fp8+fp8kv+mtp@1.0|1,8,32"
RUNS=${RUNS:-$DEFAULT_RUNS} DEVICE=${DEVICE:-cuda} STEPS=${STEPS:-16} PREFILL_REPS=${PREFILL_REPS:-2}
PREFILL_LEN=${PREFILL_LEN:-2048} DEADLINE=${DEADLINE:-570} OUT=${OUT:-/tmp/out} EXTRA_ARGS=${EXTRA_ARGS:-}
RES=/tmp/res-formats-table
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
read -r -a runs <<< "$RUNS"
left=${#runs[@]}
for spec in "${runs[@]}"; do
  IFS='|' read -r model variants batches <<< "$spec"
  share=$(( (DEADLINE - SECONDS) / left ))
  left=$((left - 1))
  name=$(basename "$model")
  if [ "$share" -lt 20 ]; then
    echo "== $name skipped: ${share} s left for it" | tee "$RES/$name.log"
    continue
  fi
  # shellcheck disable=SC2086  # EXTRA_ARGS: extra flags, split on spaces
  TAIL_LINES=${TAIL_LINES:-12} run "$name" "$share" python3 bench/spec_decode.py --model "$model" --device "$DEVICE" \
    --variants "$variants" --batches "$batches" --steps "$STEPS" --prefill-len "$PREFILL_LEN" \
    --prefill-reps "$PREFILL_REPS" --out "$RES" $EXTRA_ARGS
done
shopt -s nullglob
jsons=("$RES"/spec-decode-*.json)
if [ ${#jsons[@]} -gt 0 ]; then
  python3 bench/spec_decode.py --merge "${jsons[@]}" --out "$RES" | tee "$OUT/formats-table.md"
fi
tar -czf "$OUT/formats_table.tgz" -C "$RES" .
