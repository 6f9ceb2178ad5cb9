#!/usr/bin/env bash
# The L2 prefetch in one device call (H100, e4b, bf16): its GPU tests, the kernel-level chain of
# bench/l2_prefetch.py (prefetch, an idle stretch, the GEMV), then the engine microbenchmark once per VARIANTS
# entry, `name:mode:MB:points[:preset[:quantization[:kv cache dtype]]]` (G4SERVE_L2_PREFETCH, _MB, _AT; mode 0 =
# off; the preset defaults to PRESET, bf16 weights and KV), in turn on one machine.
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/l2_prefetch.sh", carry=[".whl"])
# Everything lands in $OUT/l2_prefetch.tgz; the logs' tails are in $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} BATCHES=${BATCHES:-1,8,64} OUT=${OUT:-/tmp/out} RUN_GPU_TESTS=${RUN_GPU_TESTS:-1}
KERNEL_ARGS=${KERNEL_ARGS:-} RUN_KERNEL=${RUN_KERNEL:-1}
VARIANTS=${VARIANTS:-"off:0:24:attn,mlp,tail bulk24:bulk:24:attn,mlp,tail line24:line:24:attn,mlp,tail"}
RES=/tmp/res-l2
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TAIL_LINES=${TAIL_LINES:-14}
[ "$RUN_KERNEL" = 1 ] && run kernel "${KERNEL_TIMEOUT:-150}" python3 bench/l2_prefetch.py $KERNEL_ARGS --out-dir "$RES"
if [ "$RUN_GPU_TESTS" = 1 ]; then
  run gpu_tests "${GPU_TESTS_TIMEOUT:-150}" python3 -m pytest -q -m gpu tests/gpu/test_l2_prefetch_gpu.py -p no:cacheprovider
fi
for v in $VARIANTS; do
  IFS=: read -r name mode mb points preset quant kv <<< "$v"
  G4SERVE_L2_PREFETCH=$mode G4SERVE_L2_PREFETCH_MB=$mb G4SERVE_L2_PREFETCH_AT=$points \
    run "engine-$name" "${ENGINE_TIMEOUT:-100}" python3 bench/engine_microbench.py --model "${preset:-$PRESET}" \
    --device cuda --attention-backend triton --batches "$BATCHES" --decode-steps 16 --prefill-lengths 128 \
    --prefill-reps 3 ${quant:+--quantization $quant} ${kv:+--kv-cache-dtype $kv} \
    --profile-batches "${PROFILE_BATCHES:-}" --out "$RES" --tag="-l2-$name"
done
{
  for f in "$RES"/*.log; do echo "## $(basename "$f")"; echo '```'; tail -n 40 "$f"; echo '```'; done
} > "$OUT/summary.md"
tar -czf "$OUT/l2_prefetch.tgz" -C "$RES" .
