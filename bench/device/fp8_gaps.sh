#!/usr/bin/env bash
# Issue 22's two FP8 decode gaps in the 26b-a4b seed workload (docs/benchmarks.md, "the seed workload's
# roofline": its FP8 decode steps took 11.5 ms against an 8.7 ms floor, and an FP8 KV cache added 0.2 ms a
# step where its bytes should save ~1 ms), kernel by kernel, in one call:
#   the paged decode kernel on an FP8 and a bf16 cache at the seed's shapes (30 sequences; the sliding layers'
#   16 query / 8 KV heads of 256 at 1,024 and 3,000 tokens, the global layers' 2 KV heads of 512 at 3,000),
#   each with its tile sweep (bench/attention_kernels.py --kv-cache-dtype auto fp8 --sweep);
#   the FP8 experts at 30 and 240 tokens (the seed's decode steps) and 8,192 (its prompt steps, which FP8 did
#   not speed up), dequantized in registers and on the FP8 tensor cores, against bf16
#   (bench/moe_kernels.py --quant fp8).
# ATTN=0 skips the attention runs, ATTN_SWEEP=0 their sweeps (the default tiles alone); MOE_TOKENS (default
# "30 240 8192") sets the experts' token counts, MOE_SWEEP=1 searches their tiles on the path the engine takes
# (FP8: W8A8). GPU_TESTS (pytest paths; -k GPU_TESTS_K) run first. SEED (default empty) lists variants of the
# 26b-a4b seed workload to run after the kernels (bench/offline_throughput.py, 30 x 3,000 in / 100 out):
# "fp8", "fp8+fp8kv", each optionally "@groups" (G4SERVE_MOE_W8A8_ROWS=0: the experts' activations quantized
# per 128-column group instead of per token), e.g. SEED="fp8+fp8kv fp8+fp8kv@groups".
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/fp8_gaps.sh", carry=[".whl"])
# Results: $OUT/fp8_gaps.tgz (JSON and logs); the logs' tails in $OUT/summary.md.
set -uo pipefail
ATTN=${ATTN:-1} ATTN_SWEEP=${ATTN_SWEEP:-1} MOE_TOKENS=${MOE_TOKENS:-30 240 8192} MOE_SWEEP=${MOE_SWEEP:-0}
GPU_TESTS=${GPU_TESTS:-} GPU_TESTS_K=${GPU_TESTS_K:-} SEED=${SEED:-}
OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-fp8-gaps}
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
gpu_tests "${TESTS_TIMEOUT:-150}"
attention() {  # attention NAME ARGS...: the decode kernel on both caches, with its sweep
  local name=$1
  shift
  local sweep=()
  [ "$ATTN_SWEEP" = 1 ] && sweep=(--sweep)
  run "$name" "${ATTN_TIMEOUT:-200}" python3 bench/attention_kernels.py --kinds decode --kv-cache-dtype auto fp8 \
    --batch 30 --q-heads 16 "${sweep[@]}" --out-dir "$RES" "$@"
}
if [ "$ATTN" = 1 ]; then
  attention attn-sliding --kv-heads 8 --head-dims 256 --context 1024 3000
  attention attn-global --kv-heads 2 --head-dims 512 --context 3000
fi
moe_flags=()
[ "$MOE_SWEEP" = 1 ] && moe_flags=(--sweep)
# shellcheck disable=SC2086  # MOE_TOKENS: several words
run moe-fp8 "${MOE_TIMEOUT:-150}" python3 bench/moe_kernels.py --quant fp8 --tokens $MOE_TOKENS "${moe_flags[@]}" \
  --out-dir "$RES"
for variant in $SEED; do
  rows=1 flags=(--quantization fp8)
  [[ $variant == *@groups ]] && rows=0
  [[ $variant == fp8+fp8kv* ]] && flags+=(--kv-cache-dtype fp8)
  G4SERVE_MOE_W8A8_ROWS=$rows run "seed-${variant//@/-}" "${SEED_TIMEOUT:-150}" python3 bench/offline_throughput.py \
    --device cuda --model 26b-a4b --num-requests 30 --input-len 3000 3000 --output-len 100 "${flags[@]}" \
    --out-dir "$RES" --tag "${variant//@/-}"
done
pack fp8_gaps "${SUMMARY_LINES:-40}"
