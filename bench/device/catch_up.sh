#!/usr/bin/env bash
# The work written in sessions without device time, checked and measured in four lanes, one GPU each on a
# four-GPU machine (two lanes a GPU on two, all in turn on one), after the two-GPU NCCL test:
#   kernels: the GPU tests of that work (the per-token FP8 quantizer kernels/fp8_rows.py, the three-launch MoE
#          alignment, W8A8 MoE experts, media prepared on the GPU); bench/moe_kernels.py --quant fp8
#          (align_p against align_t, FP8 experts dequantized against W8A8); bench/preprocess_media.py
#          --device cuda (the --media-on-gpu path's pieces); the persistent decode-tail kernel: its GPU tests
#          and bench/decode_tail.py (e4b and 31b, M = 1-8); bench/sampler.py (top-k in the sort-free kernel,
#          G4SERVE_SORT_FREE_TOP_K, against torch.topk); tailsweep: the decode tail's coarse sweep at one
#          row (small tiles on 4 warps, 4-12 programs per SM: more weight bytes in flight per SM)
#   seed:  26b-a4b's seed workload with the sorted and the three-launch alignment (G4SERVE_MOE_ALIGN)
#   quant: e4b's FP8 prefill (TTFT of 2,048 tokens) with the one-launch quantizer, and with BASE_TGZ (a
#          `git archive` of an older commit's src/, e.g. 045bea9^) the same on those sources; 26b-a4b's FP8
#          prefill with the experts dequantized and W8A8 (G4SERVE_MOE_W8A8_MIN=1); e4b in int4 (B = 1-64,
#          prefill of 512 and 2,048 tokens) on tinygemm and on the dense path (kernels/dequant.py, then
#          cuBLAS: G4SERVE_QUANT_PREFILL=dequant, G4SERVE_INT4_DENSE_ROWS=2), after their GPU tests; e4b
#          decode with the decode-tail kernel off and on (G4SERVE_DECODE_TAIL), B = 1/8, and FP8 e4b decode
#          with the norms quantizing for the W8A8 projections off and on (G4SERVE_FP8_NORM_QUANT), B = 1/8
#   served: media_stall.sh with MODES=$STALL_MODES (default "insteps gpumedia capped"; e.g. split140p256)
#          at VIDEO_QPS (default 32; capped: --max-prefill-tokens-beside-decodes PREFILL_CAP, 512); then
#          the audio rows: clips at 4 QPS beside text streams, log-mel on the host and with --media-on-gpu
#          (port 8101)
# STAGES picks the work inside the lanes (default: all of it). On four GPUs one call of under 10 minutes:
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/catch_up.sh", carry=[".whl", "build/base.tgz"],
#       kind="nvidia-h200-x4")
# on two GPUs two calls (STAGES="nccl tests kernels media tail tailsweep seed fp8 int4", then STAGES="stall audio").
# Results: $OUT/catch_up.tgz (JSON, logs), the tables and test summaries in $OUT/summary.md.
set -uo pipefail
STAGES=${STAGES:-nccl tests kernels media tail tailsweep seed fp8 int4 stall audio} DEADLINE=${DEADLINE:-560} OUT=${OUT:-/tmp/out}
VIDEO_QPS=${VIDEO_QPS:-32} BASE_TGZ=${BASE_TGZ:-build/base.tgz} STALL_MODES=${STALL_MODES:-insteps gpumedia capped}
RES=/tmp/res-catch-up
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
has() { [[ " $STAGES " == *" $1 "* ]]; }
left() { echo $(( DEADLINE - SECONDS - $1 )); }  # seconds left before DEADLINE, less a reserve

lane_kernels() {
  export CUDA_VISIBLE_DEVICES=$1
  if has tests; then
    run gpu-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_media_gpu.py \
      tests/gpu/test_quant_gpu.py tests/gpu/test_moe_gpu.py \
      tests/gpu/test_moe_quant_gpu.py -k "align or media or nvjpeg or resize or quantize_rows or w8a8 or \
      quant_matmul or quantized_fused_moe"
  fi
  has kernels && run moe-kernels 150 python3 bench/moe_kernels.py --quant fp8 --tokens 64 512 2048 4096 \
    --out-dir "$RES"
  has media && run preprocess-media 90 python3 bench/preprocess_media.py --device cuda --reps 20 --out-dir "$RES"
  if has tail; then
    run tail-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_decode_tail_gpu.py \
      tests/gpu/test_fp8_norm_quant_gpu.py tests/gpu/test_kernels_gpu.py -k "tail or norm_quant or fp8 or top_"
    run decode-tail 150 python3 bench/decode_tail.py --presets e4b 31b --out-dir "$RES"
    run sampler 120 python3 bench/sampler.py --batches 1 8 64 --out-dir "$RES"
  fi
  if has tailsweep; then  # the decode tail at one row: small tiles, 4-12 programs per SM (36 configs)
    run decode-tail-sweep 240 python3 bench/decode_tail.py --presets e4b --rows 1 --sweep --sweep-grid coarse \
      --out-dir "$RES"
  fi
}

lane_seed() {
  export CUDA_VISIBLE_DEVICES=$1
  if has seed; then
    for align in sort parallel; do
      G4SERVE_MOE_ALIGN=$align run "seed-align-$align" 150 \
        python3 bench/offline_throughput.py --model 26b-a4b --device cuda --num-requests 30 --input-len 3000 3000 \
        --output-len 100 --tag "align-$align" --out-dir "$RES"
    done
  fi
}

lane_quant() {
  export CUDA_VISIBLE_DEVICES=$1
  if has fp8; then
    fp8=(bench/engine_microbench.py --model e4b --device cuda --quantization fp8 --batches 1 --decode-steps 8
      --prefill-lengths 512,2048 --prefill-reps 3)
    run fp8-prefill-head 120 python3 "${fp8[@]}" --out "$RES/fp8-head"
    moe=(bench/engine_microbench.py --model 26b-a4b --device cuda --quantization fp8 --batches 1 --decode-steps 8
      --prefill-lengths 2048 --prefill-reps 3)
    run fp8-moe-prefill-dequant 120 python3 "${moe[@]}" --out "$RES/fp8-moe-dequant"
    G4SERVE_MOE_W8A8_MIN=1 run fp8-moe-prefill-w8a8 120 python3 "${moe[@]}" --out "$RES/fp8-moe-w8a8"
    if [ -f "$BASE_TGZ" ]; then
      mkdir -p /tmp/base && tar -xzf "$BASE_TGZ" -C /tmp/base
      PYTHONPATH=/tmp/base/src:${PYTHONPATH#"$PWD/src:"} run fp8-prefill-base 120 python3 "${fp8[@]}" \
        --out "$RES/fp8-base"
    fi
  fi
  if has int4; then  # e4b in int4 (w4a16) at every batch, and prefill: decode on tinygemm (the default), then
    # the dense path (G4SERVE_QUANT_PREFILL=dequant, G4SERVE_INT4_DENSE_ROWS=2: kernels/dequant.py, then
    # cuBLAS) from two rows and past 64, after the GPU tests of both
    run int4-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_quant_gpu.py \
      -k "dequantize_kernel or dense"
    int4=(bench/engine_microbench.py --model e4b --device cuda --quantization w4a16 --batches 1,2,8,16,32,64
      --decode-steps 16 --prefill-lengths 512,2048 --prefill-reps 2)
    run int4-e4b-tinygemm 150 python3 "${int4[@]}" --out "$RES/int4-tinygemm" --tag="-tinygemm"
    G4SERVE_QUANT_PREFILL=dequant G4SERVE_INT4_DENSE_ROWS=2 run int4-e4b-dense 150 python3 "${int4[@]}" \
      --out "$RES/int4-dense" --tag="-dense"
  fi
  if has tail; then  # decode steps with each layer's tail after attention in one persistent launch, or not
    for on in 0 1; do
      G4SERVE_DECODE_TAIL=$on run "decode-tail-e4b-$on" 100 python3 bench/engine_microbench.py --model e4b \
        --device cuda --batches 1,8 --decode-steps 16 --prefill-lengths 512 --prefill-reps 1 \
        --out "$RES/decode-tail-$on" --tag="-tail$on"
      G4SERVE_FP8_NORM_QUANT=$on run "fp8-norm-quant-e4b-$on" 100 python3 bench/engine_microbench.py \
        --model e4b --device cuda --quantization fp8 --batches 1,8 --decode-steps 16 --prefill-lengths 512 \
        --prefill-reps 1 --out "$RES/fp8-norm-quant-$on" --tag="-normq$on"
    done
  fi
}

lane_served() {
  export CUDA_VISIBLE_DEVICES=$1
  if has stall; then
    MODES=$STALL_MODES VIDEO_QPS=$VIDEO_QPS SETUP=0 OUT="$RES/stall" RES="$RES/stall-work" \
      timeout -k 5 "$(left 30)" bash bench/device/media_stall.sh > "$RES/media-stall.log" 2>&1
  fi
  if has audio; then  # the audio rows: clips at 4 QPS beside text streams, log-mel on the host or the GPU
    MODES="insteps gpumedia" MEDIA=audio VIDEO_QPS=4 PORT=8101 SETUP=0 OUT="$RES/audio" RES="$RES/audio-work" \
      timeout -k 5 "$(left 30)" bash bench/device/media_stall.sh > "$RES/audio-stall.log" 2>&1
  fi
}

if has nccl && [ "$gpus" -ge 2 ]; then  # the TP engine's NCCL stop and start, now that a worker frees its
  # graphs with ModelRunner.release_graphs (not run on two GPUs since)
  run nccl 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py -k nccl
fi
if [ "$gpus" -ge 4 ]; then
  lane_kernels 0 & lane_seed 1 & lane_quant 2 & lane_served 3 & wait
elif [ "$gpus" -ge 2 ]; then
  (lane_kernels 0; lane_served 0) & (lane_seed 1; lane_quant 1) & wait
else
  lane_kernels 0; lane_seed 0; lane_quant 0; lane_served 0
fi
{
  echo "## NCCL (two GPUs)"; tail -n 3 "$RES/nccl.log" 2>/dev/null
  echo "## GPU tests"; tail -n 15 "$RES/gpu-tests.log" 2>/dev/null
  echo "## MoE alignment"; grep -E "align|tokens" "$RES/moe-kernels.log" 2>/dev/null | tail -n 20
  echo "## preprocess_media"; grep -E "_ms " "$RES/preprocess-media.log" 2>/dev/null
  echo "## media stall"; cat "$RES/stall/summary.md" 2>/dev/null
  echo "## audio beside text"; cat "$RES/audio/summary.md" 2>/dev/null
  echo "## decode tail kernel"; tail -n 3 "$RES/tail-tests.log" 2>/dev/null
  grep -hE "H=|best" "$RES/decode-tail.log" "$RES/decode-tail-sweep.log" 2>/dev/null; grep -hE "ITL|decode" "$RES"/decode-tail-e4b-*.log "$RES"/fp8-norm-quant-e4b-*.log 2>/dev/null
  echo "## sampler"; grep -hE "top_k" "$RES/sampler.log" 2>/dev/null
  echo "## seed"; grep -hE "tok/s|throughput" "$RES"/seed-align-*.log 2>/dev/null
  echo "## fp8 prefill"; grep -hE "TTFT|prefill" "$RES"/fp8-*.log 2>/dev/null
  echo "## int4 e4b (tinygemm, then the dense path)"; tail -n 3 "$RES/int4-tests.log" 2>/dev/null
  grep -hE "ITL|TTFT|decode|prefill" "$RES"/int4-e4b-tinygemm.log "$RES"/int4-e4b-dense.log 2>/dev/null
} > "$OUT/summary.md"
cat "$OUT/summary.md"
tar -czf "$OUT/catch_up.tgz" -C "$RES" .
