#!/usr/bin/env bash
# int4 (w4a16) kernels on the device, this tree against an older one, in one call. Stages (STAGES picks and orders
# them; a name ending in -base runs on BASE_SRC, an untracked copy of an older src/: `git archive <rev> src | tar -x
# -C .ab-base`, carried; default .ab-base/src):
#   gemv      every e4b decode projection (bench/gemv_kernels.py --quant w4a16 --rows ROWS: the Triton kernel, tinygemm
#             and bf16 side by side; SWEEP=1 also searches tiles, on this tree);
#   moe       the 26b-a4b experts (bench/moe_kernels.py --quant w4a16);
#   engine-X  the e4b engine (bench/engine_microbench.py --quantization w4a16 --batches BATCHES) with
#             G4SERVE_INT4_MATMUL=X (auto, tinygemm or triton);
#   gpu-tests the int4 GPU tests named by GPU_TESTS_K (default: the PTX planes against the fp32 ones; not by default).
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/int4_ab.sh", carry=[".ab-base", ".whl"])
# The kernel stages need torch and triton only; the engine stages the carried wheels (.whl). A stage gets at most
# its share of DEADLINE (default 560 s). Everything lands in $OUT/int4_ab.tgz; the logs' tails in $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} MOE_PRESET=${MOE_PRESET:-26b-a4b} ROWS=${ROWS:-1 2 8 16} BATCHES=${BATCHES:-1,8,16}
SWEEP=${SWEEP:-1} BASE_SRC=${BASE_SRC:-.ab-base/src} DEADLINE=${DEADLINE:-560} OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-gemv gemv-base moe moe-base engine-triton engine-triton-base engine-tinygemm}
RES=/tmp/res-int4-ab
mkdir -p "$RES" "$OUT"
[ -d "${WHEELS:-.whl}" ] || export SETUP=0  # the engine stages need the server's wheels (carry .whl)
source bench/device/setup.sh
export TAIL_LINES=${TAIL_LINES:-16}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-int4-ab}
read -r -a stages <<< "$STAGES"
read -r -a rows <<< "$ROWS"
here=$PYTHONPATH
left=${#stages[@]}
for stage in "${stages[@]}"; do
  left=$((left - 1))
  share=$((DEADLINE - SECONDS - 30 * left))
  [ "$share" -gt 200 ] && share=200
  if [ "$share" -lt 30 ]; then echo "== $stage skipped: ${share} s left for it" | tee "$RES/$stage.log"; continue; fi
  export PYTHONPATH=$here
  sweep=()
  if [[ "$stage" == *-base ]]; then
    export PYTHONPATH=$PWD/$BASE_SRC:$here
  elif [ "$SWEEP" = 1 ]; then
    sweep=(--sweep --compile-workers 12)
  fi
  case "$stage" in
    gpu-tests) run "$stage" "$share" python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_quant_gpu.py \
      tests/gpu/test_moe_quant_gpu.py -k "${GPU_TESTS_K:-ptx_planes}" ;;
    gemv*) run "$stage" "$share" python3 bench/gemv_kernels.py --preset "$PRESET" --quant w4a16 --rows "${rows[@]}" \
      "${sweep[@]}" --calls-per-graph 16 --graph-replays 5 --out-dir "$RES/$stage" ;;
    moe*) run "$stage" "$share" python3 bench/moe_kernels.py --preset "$MOE_PRESET" --quant w4a16 --tokens 1 8 64 512 \
      --out-dir "$RES/$stage" ;;
    engine-*) path=${stage#engine-}; path=${path%-base}
      G4SERVE_INT4_MATMUL=$path run "$stage" "$share" python3 bench/engine_microbench.py --model "$PRESET" \
        --device cuda --attention-backend triton --quantization w4a16 --batches "$BATCHES" --decode-steps 16 \
        --prefill-lengths 512 --prefill-reps 2 --out "$RES/$stage" --tag="-$stage" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
pack int4_ab 40 "# int4 A/B: STAGES=$STAGES ($SECONDS s)"
