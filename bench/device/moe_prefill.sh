#!/usr/bin/env bash
# Issue 23's MoE prefill row in one device call, both halves at once on a two-GPU machine (one GPU: in turn):
#   GPU 0: the expert block alone at prefill sizes, searching tiles (bench/moe_kernels.py --sweep)
#   GPU 1: 26b-a4b's seed workload (30 prompts of 3,000 tokens, 100 out; bench/offline_throughput.py) at each
#          token budget of BUDGETS, then where a 2,048-token prefill's time goes (engine_microbench
#          --profile-prefill: the kernel table)
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/moe_prefill.sh", carry=[".whl"], kind="nvidia-h200-x2")
# TOKENS (default "512 2048 4096") the sweep's token counts; SWEEP=0 skips the sweep (an after-run). Results:
# $OUT/moe_prefill.tgz (JSON, kernel tables, logs).
set -uo pipefail
TOKENS=${TOKENS:-512 2048 4096} SWEEP=${SWEEP:-1} BUDGETS=${BUDGETS:-2048 8192} DEADLINE=${DEADLINE:-560} OUT=${OUT:-/tmp/out}
RES=/tmp/res-moe-prefill
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
second=$(second_gpu)
sweep_flag=$([ "$SWEEP" = 1 ] && echo --sweep || echo "")
# shellcheck disable=SC2086  # TOKENS: several words; sweep_flag: empty or one
CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((DEADLINE - 20)) python3 bench/moe_kernels.py --tokens $TOKENS $sweep_flag \
  --out-dir "$RES" > "$RES/moe_kernels.log" 2>&1 &
kernels=$!
[ "$second" = 0 ] && wait $kernels
for budget in $BUDGETS; do  # the seed workload at each token budget
  CUDA_VISIBLE_DEVICES=$second run "offline-budget$budget" $(( (DEADLINE - SECONDS) / 4 )) python3 \
    bench/offline_throughput.py --model 26b-a4b --device cuda --num-requests 30 --input-len 3000 3000 \
    --output-len 100 --max-num-batched-tokens "$budget" --tag "budget$budget" --out-dir "$RES"
done
CUDA_VISIBLE_DEVICES=$second run profile-prefill $(( DEADLINE - SECONDS - 20 )) python3 bench/engine_microbench.py \
  --model 26b-a4b --device cuda --batches 1 --decode-steps 8 --prefill-lengths 2048 --prefill-reps 2 \
  --profile-prefill 2048 --out "$RES"
wait $kernels
echo "== moe_kernels"
tail -n 40 "$RES/moe_kernels.log"
tar -czf "$OUT/moe_prefill.tgz" -C "$RES" .
