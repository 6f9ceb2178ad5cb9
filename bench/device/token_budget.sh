#!/usr/bin/env bash
# The default token budget (max_num_batched_tokens) by measurement, in one call on a two-GPU machine (one GPU:
# in turn):
#   GPU 0: the seed workloads (bench/offline_throughput.py, 30 prompts at once): e4b 7,000 in / 10 out and e2b
#          3,000 / 100 at the engine's default budget and at 2,048; 26b-a4b 3,000 / 100 at the default
#   GPU 1: served text at saturation (bench/device/saturation.sh, e4b, 500 in / 128 out, 32 and 64 QPS) at the
#          default budget and at 2,048: what the budget costs the streams' ITL
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/token_budget.sh", carry=[".whl"], kind="nvidia-h200-x2")
# Results: $OUT/token_budget.tgz (JSON and logs), the served tables in $OUT/sat-*.md.
set -uo pipefail
DEADLINE=${DEADLINE:-540} OUT=${OUT:-/tmp/out}
RES=/tmp/res-token-budget
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
second=$(second_gpu)
served() {  # served TAG [SERVE_ARGS]: saturation.sh on the second GPU (SETUP=0: the wheels are in already)
  SETUP=0 CUDA_VISIBLE_DEVICES=$second RES="$RES/sat-$1" OUT="$RES/sat-$1-out" SERVE_ARGS=${2:-} RATES="32 64" \
    DURATION=15 timeout -k 5 $(( (DEADLINE - SECONDS) / 2 )) bash bench/device/saturation.sh \
    > "$RES/sat-$1.log" 2>&1
  cp "$RES/sat-$1-out/saturation.md" "$OUT/sat-$1.md" 2>/dev/null
}
(served default; served budget2048 "--max-num-batched-tokens 2048") &
sat=$!
[ "$second" = 0 ] && wait $sat
seed() {  # seed MODEL IN OUT TAG [ARGS...]
  local model=$1 in=$2 out=$3 tag=$4
  shift 4
  CUDA_VISIBLE_DEVICES=0 run "offline-$model-$tag" 120 python3 bench/offline_throughput.py --model "$model" \
    --device cuda --num-requests 30 --input-len "$in" "$in" --output-len "$out" --tag "$tag" --out-dir "$RES" "$@"
}
seed e4b 7000 10 default
seed e4b 7000 10 budget2048 --max-num-batched-tokens 2048
seed e2b 3000 100 default
seed e2b 3000 100 budget2048 --max-num-batched-tokens 2048
seed 26b-a4b 3000 100 default
wait $sat
for tag in default budget2048; do echo "== served, $tag"; cat "$OUT/sat-$tag.md" 2>/dev/null; done
tar -czf "$OUT/token_budget.tgz" -C "$RES" .
