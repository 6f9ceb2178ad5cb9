#!/usr/bin/env bash
# Issue 23's MoE prefill row in one device call, both halves at once on a two-GPU machine (one GPU: in turn):
#   GPU 0: the expert block alone at prefill sizes, searching tiles (bench/moe_kernels.py --sweep), or with
#          KERNEL_GROUPS set each GEMM in those tile orders (--groups: GemmTiles.group_m) instead of the search
#   GPU 1: 26b-a4b's seed workload (30 prompts of 3,000 tokens, 100 out; bench/offline_throughput.py) at each
#          token budget of BUDGETS, then where a 2,048-token prefill's time goes (engine_microbench
#          --profile-prefill: the kernel table; PROFILE= skips it) and decode at B = 1 and 8; each once per
#          G4SERVE_MOE_GROUP_M value of ENGINE_GROUPS ("default": unset, the default; "best": the order whose
#          GEMMs summed least at the largest T, with KERNEL_GROUPS, on a one-GPU machine), for each side of
#          SIDES (default "now"; "base": the sources in BASE_SRC, an older src/ from `git archive <rev> src |
#          tar -x -C .ab-base`, carried; e.g. SIDES="now base now")
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/moe_prefill.sh", carry=[".whl"], kind="nvidia-h200-x2")
# TOKENS (default "512 2048 4096") the kernel bench's token counts; SWEEP=0 skips the search (an after-run);
# GPU_TESTS: a pytest -k expression of tests/gpu/test_moe_gpu.py to run first (e.g. "tile_order"). Results:
# $OUT/moe_prefill.tgz (JSON, kernel tables, logs).
set -uo pipefail
TOKENS=${TOKENS:-512 2048 4096} SWEEP=${SWEEP:-1} BUDGETS=${BUDGETS:-2048 8192} DEADLINE=${DEADLINE:-560} OUT=${OUT:-/tmp/out}
KERNEL_GROUPS=${KERNEL_GROUPS:-} ENGINE_GROUPS=${ENGINE_GROUPS:-default} GPU_TESTS=${GPU_TESTS:-}
SIDES=${SIDES:-now} BASE_SRC=${BASE_SRC:-.ab-base/src} PROFILE=${PROFILE-1}
RES=/tmp/res-moe-prefill
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
if [ -n "$GPU_TESTS" ]; then
  run gpu-tests 120 python3 -m pytest -q -m gpu tests/gpu/test_moe_gpu.py -k "$GPU_TESTS"
fi
second=$(second_gpu)
kernel_flags=()
[ "$SWEEP" = 1 ] && [ -z "$KERNEL_GROUPS" ] && kernel_flags+=(--sweep)
# shellcheck disable=SC2206  # KERNEL_GROUPS: several words
[ -n "$KERNEL_GROUPS" ] && kernel_flags+=(--groups $KERNEL_GROUPS)
# shellcheck disable=SC2086  # TOKENS: several words
CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((DEADLINE - 20)) python3 bench/moe_kernels.py --tokens $TOKENS \
  "${kernel_flags[@]}" --out-dir "$RES" > "$RES/moe_kernels.log" 2>&1 &
kernels=$!
[ "$second" = 0 ] && wait $kernels
if [[ " $ENGINE_GROUPS " == *" best "* ]]; then  # the order whose two GEMMs summed least at the largest T
  best=$(python3 -c "
import glob, json, sys
row = json.load(open(sorted(glob.glob(sys.argv[1] + '/moe_kernels*.json'))[-1]))['results'][-1]
print(min(row['groups']['trials'], key=lambda t: t['gate_up_ms'] + t['down_ms'])['group_m'])" "$RES")
  echo "== the best tile order at the largest T: group_m ${best:-none}"
  ENGINE_GROUPS=${ENGINE_GROUPS//best/${best:-}}
fi
i=0
for side in $SIDES; do  # now: this tree; base: the sources in BASE_SRC
  path=$PYTHONPATH
  [ "$side" = base ] && path=$PWD/$BASE_SRC:$PYTHONPATH
  for g in $ENGINE_GROUPS; do  # default: G4SERVE_MOE_GROUP_M unset
    i=$((i + 1))
    name="$i-$side-g$g" genv=(env -u G4SERVE_MOE_GROUP_M)
    [ "$g" != default ] && genv=(env G4SERVE_MOE_GROUP_M="$g")
    for budget in $BUDGETS; do  # the seed workload at each token budget
      PYTHONPATH=$path CUDA_VISIBLE_DEVICES=$second run "offline-$name-budget$budget" \
        $(( (DEADLINE - SECONDS) / 3 )) "${genv[@]}" python3 bench/offline_throughput.py --model 26b-a4b \
        --device cuda --num-requests 30 --input-len 3000 3000 --output-len 100 --max-num-batched-tokens "$budget" \
        --tag "$name-budget$budget" --out-dir "$RES"
    done
    PYTHONPATH=$path CUDA_VISIBLE_DEVICES=$second run "profile-prefill-$name" $(( (DEADLINE - SECONDS) / 2 )) \
      "${genv[@]}" python3 bench/engine_microbench.py --model 26b-a4b --device cuda --batches 1,8 --decode-steps 16 \
      --prefill-lengths 2048 --prefill-reps 3 ${PROFILE:+--profile-prefill 2048} --tag "$name" --out "$RES"
  done
done
wait $kernels
echo "== moe_kernels"
tail -n 40 "$RES/moe_kernels.log"
tar -czf "$OUT/moe_prefill.tgz" -C "$RES" .
