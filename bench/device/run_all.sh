#!/usr/bin/env bash
# Issue 6's benchmark suite in one device call (< 10 min on an H100), e4b preset (random weights, bf16):
#   1. GPU tests                                              RUN_GPU_TESTS=1   (<= 75 s)
#   2. engine microbenchmarks, Triton backend (decode B=1/8/32/64, prefill 128/512/2048, bandwidth floor,
#      batch-1 kernel profile), then the vision encoder (6 frames of 480p) against transformers' tower
#                                                             MICROBENCH_TORCH=1 adds the torch backend (<= 90 s each)
#   3. g4serve serve --preset e4b: text and video sweeps (1 and 4 QPS, 8 s each), then the extraction grid
#      (prompts 512/1024/2048 x outputs 16/128 x schema off/on, 2 requests per cell)         RUN_GRID=1
#      SERVE_ARGS adds server flags (e.g. "--overlap-encoder", "--no-async-scheduling"); MICROBENCH_ARGS adds
#      flags to the microbenchmark. RUN_MICROBENCH=0 / RUN_VISION=0 skip stage 2's parts; RES
#      (default /tmp/res) is the working directory, for several runs in one call
#   4. the peer, `transformers serve` on the same shapes (bench/peer_serve.py), the same text sweep   RUN_PEER=1
#      (PEER_SERVE_ARGS="--compile" for its static-cache + torch.compile mode; video: not supported by it)
#   5. the peer's `generate` microbenchmark (bench/peer_transformers.py: eager rows, prefill rows, then the
#      compiled rows), bounded by the time left
#   6. g4serve bench compare: g4serve vs transformers serve (text), plots
# Every stage runs under `timeout`, cut to the time left before DEADLINE (default 550 s) less a reserve for
# the stages after it; a stage with under 10 s left is skipped (the last ones may run 20 s past DEADLINE). Its exit code and seconds land in stages.tsv. Everything is in $OUT/results.tgz;
# $OUT/summary.md has every table. Usage (device tool), with the commit of the tree you send (the device's
# copy of .git is stale):
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/run_all.sh", carry=[".whl"])
# A smoke test of the plumbing on a CPU box (tiny preset, no wheels; minutes, figures meaningless):
#   SETUP=0 PRESET=tiny DEVICE=cpu BACKEND=torch RUN_GPU_TESTS=0 PEER_SERVE_ARGS="--dtype float32" \
#   PEER_GENERATE_ARGS="--dtype float32" OUT=/tmp/out bash bench/device/run_all.sh
set -uo pipefail
DEADLINE=${DEADLINE:-550}
PRESET=${PRESET:-e4b} DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-triton} SETUP=${SETUP:-1}
PEER_GENERATE_ARGS=${PEER_GENERATE_ARGS:-}
RUN_GPU_TESTS=${RUN_GPU_TESTS:-1} MICROBENCH_TORCH=${MICROBENCH_TORCH:-0} RUN_GRID=${RUN_GRID:-1}
RUN_PEER=${RUN_PEER:-1} PEER_SERVE_ARGS=${PEER_SERVE_ARGS:-} SERVE_ARGS=${SERVE_ARGS:-}
MICROBENCH_ARGS=${MICROBENCH_ARGS:-}
OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res}
RUN_MICROBENCH=${RUN_MICROBENCH:-1} RUN_VISION=${RUN_VISION:-1}
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh  # SETUP=0: no wheels (CPU smoke test)
if [ -z "${G4SERVE_GIT_COMMIT:-}" ]; then
  echo "warning: G4SERVE_GIT_COMMIT is not set; the JSON files will name the stale commit of the device's .git"
fi
printf 'stage\texit\tseconds\n' > "$RES/stages.tsv"
# What each stage leaves for the ones after it counts only the stages that will run (all on: the reserves
# below add up to 340 s after the GPU tests); e.g. RUN_PEER=0 RUN_GRID=0 DEADLINE=250 fits the server stages.
on() { [ "$1" = 1 ] && echo "$2" || echo 0; }
PEER_SECS=$(on "$RUN_PEER" 160) GRID_SECS=$(on "$RUN_GRID" 50) VISION_SECS=$(on "$RUN_VISION" 10)
MICRO_SECS=$(on "$RUN_MICROBENCH" 40) SERVE_SECS=80  # the server's start and its two sweeps

limit() {  # limit WANT [RESERVE]: WANT seconds, or what is left before DEADLINE less RESERVE if that is less
  local l=$(( DEADLINE - SECONDS - ${2:-0} ))
  (( l > $1 )) && l=$1
  (( l < 0 )) && l=0
  echo "$l"
}
stage() {  # stage NAME SECONDS CMD...: CMD under timeout, output in $RES/NAME.log, exit code in stages.tsv
  local name=$1 secs=$2 t0=$SECONDS rc
  shift 2
  if (( secs < 10 )); then
    printf '%s\tskipped\t0\n' "$name" >> "$RES/stages.tsv"
    echo "== $name: skipped, no time left"
    return 1
  fi
  echo "== $name (at ${SECONDS}s, limit ${secs}s)"
  timeout -k 10 "$secs" "$@" > "$RES/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$RES/stages.tsv"
  tail -n 8 "$RES/$name.log"
  return $rc
}
stop() {  # stop PID: SIGINT (graceful), then SIGKILL after 30 s
  kill -INT "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || { wait "$1" 2>/dev/null; return 0; }; sleep 1; done
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no GPU"; } | tee "$RES/gpu.txt"
python3 -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
"transformers", transformers.__version__)' | tee -a "$RES/gpu.txt"
echo "G4SERVE_GIT_COMMIT=${G4SERVE_GIT_COMMIT:-unset}" >> "$RES/gpu.txt"

# 1. correctness on the GPU
if [ "$RUN_GPU_TESTS" = 1 ]; then
  stage gpu_tests "$(limit 75 $((MICRO_SECS + VISION_SECS + SERVE_SECS + GRID_SECS + PEER_SECS)))" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider
fi

# 2. engine microbenchmarks
backends=$BACKEND
[ "$MICROBENCH_TORCH" = 1 ] && [ "$BACKEND" != torch ] && backends="$BACKEND torch"
[ "$RUN_MICROBENCH" = 1 ] || backends=""
for backend in $backends; do
  stage "microbench-$backend" "$(limit 100 $((VISION_SECS + SERVE_SECS + GRID_SECS + PEER_SECS)))" python3 bench/engine_microbench.py --model "$PRESET" --device "$DEVICE" \
    --attention-backend "$backend" --batches 1,8,32,64 --decode-steps 16 --prefill-reps 3 --profile \
    $MICROBENCH_ARGS --out "$RES" --tag="-$backend"
done
# vision encoder: 6 frames of 480p, g4serve (graph and eager) beside transformers' vision tower
[ "$RUN_VISION" = 1 ] && stage vision "$(limit 60 $((SERVE_SECS + GRID_SECS + PEER_SECS)))" python3 bench/vision_encoder.py --model "$PRESET" --device "$DEVICE" --frames 6 \
  --size 854x480 --out "$RES"

# 3. g4serve: text and video sweeps, extraction grid
SWEEP=(--rates 1,4 --duration 8 --warmup 8 --drain-timeout 30)
python3 -m g4serve.cli serve --preset "$PRESET" --device "$DEVICE" --port 8100 --attention-backend "$BACKEND" \
  --max-num-seqs 64 $SERVE_ARGS > "$RES/g4serve_server.log" 2>&1 &
SERVER=$!
t0=$SECONDS
if wait_healthy 8100 $SERVER "$(limit 180 $((30 + GRID_SECS + PEER_SECS)))"; then
  printf 'g4serve_start\t0\t%s\n' "$((SECONDS - t0))" >> "$RES/stages.tsv"
  for wl in text video; do
    reserve=$(( $([ "$wl" = text ] && echo 40 || echo 10) + PEER_SECS ))  # the video sweep, then the peer
    stage "sweep-$wl" "$(limit 90 "$reserve")" python3 -m g4serve.cli bench --workload "$wl" \
      --base-url http://127.0.0.1:8100 "${SWEEP[@]}" --out "$RES/sweep-$wl" --label "g4serve-$PRESET"
  done
  # The e4b preset serves with the tiny tokenizer, whose extraction instructions alone take ~280 tokens:
  # a 128-token prompt is out of reach there, so the grid starts at 512.
  if [ "$RUN_GRID" = 1 ]; then
    stage grid-g4serve "$(limit 90 "$PEER_SECS")" python3 -m g4serve.cli bench grid --base-url http://127.0.0.1:8100 \
      --prompt-tokens 512,1024,2048 --output-tokens 16,128 --requests-per-cell 2 --concurrency 1 \
      --out "$RES/grid-g4serve" --label "g4serve-$PRESET"
  fi
else
  printf 'g4serve_start\tfailed\t%s\n' "$((SECONDS - t0))" >> "$RES/stages.tsv"
  tail -n 30 "$RES/g4serve_server.log"
fi
stop $SERVER

# 4-5. the peer
if [ "$RUN_PEER" = 1 ]; then
  PEER_MODEL=/tmp/g4serve-peer-$PRESET  # the tokenizer directory: the model name transformers serve answers to
  # shellcheck disable=SC2086  # PEER_SERVE_ARGS is a list of flags
  python3 bench/peer_serve.py --preset "$PRESET" --device "$DEVICE" --port 8200 --tokenizer-dir "$PEER_MODEL" \
    $PEER_SERVE_ARGS > "$RES/peer_server.log" 2>&1 &
  PEER=$!
  t0=$SECONDS
  if wait_healthy 8200 $PEER "$(limit 120 100)"; then
    printf 'peer_start\t0\t%s\n' "$((SECONDS - t0))" >> "$RES/stages.tsv"
    # transformers serve rejects ignore_eos (HTTP 422); its own generation_config field with a large
    # min_new_tokens holds every answer to max_tokens instead.
    stage peer-sweep-text "$(limit 110 55)" python3 -m g4serve.cli bench --workload text \
      --base-url http://127.0.0.1:8200 --model "$PEER_MODEL" --no-ignore-eos \
      --extra-body '{"generation_config": "{\"min_new_tokens\": 100000}"}' "${SWEEP[@]}" \
      --out "$RES/peer-sweep-text" --label transformers-serve
  else
    printf 'peer_start\tfailed\t%s\n' "$((SECONDS - t0))" >> "$RES/stages.tsv"
    tail -n 30 "$RES/peer_server.log"
  fi
  stop $PEER
  budget=$(limit 180 20)
  # shellcheck disable=SC2086  # PEER_GENERATE_ARGS is a list of flags
  stage peer-generate "$budget" python3 bench/peer_transformers.py --preset "$PRESET" --device "$DEVICE" \
    --eager-batches 1,8 --batches 1,8 --prefill-lengths 128,512,2048 --decode-tokens 17 --reps 3 \
    --time-budget-s $(( budget > 20 ? budget - 15 : 5 )) --out "$RES" $PEER_GENERATE_ARGS
fi

# 6. side by side, and the summary
if [ -f "$RES/sweep-text/results.json" ] && [ -f "$RES/peer-sweep-text/results.json" ]; then
  stage compare-text "$(limit 30 -20)" python3 -m g4serve.cli bench compare "$RES/sweep-text/results.json" \
    "$RES/peer-sweep-text/results.json" --out "$RES/compare-text"
fi
{
  echo "# run_all.sh on $(head -2 "$RES/gpu.txt" | tail -1)"; echo
  cat "$RES/gpu.txt"; echo; echo '```'; cat "$RES/stages.tsv"; echo '```'
  for f in "$RES"/compare-text/compare.md "$RES"/sweep-*/results.md "$RES"/peer-sweep-text/results.md \
           "$RES"/grid-g4serve/grid.md; do
    [ -f "$f" ] && { echo; cat "$f"; }
  done
  for f in "$RES"/microbench-*.json "$RES"/peer-transformers-*.json; do
    [ -f "$f" ] && { echo; echo "## $(basename "$f")"; echo '```'; python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("decode_floor_batch1_ms", "copy_bandwidth_gb_per_s", "load_s", "dynamo_unique_graphs", "elapsed_s")
print({k: d[k] for k in keys if k in d})
for k in ("decode", "prefill", "skipped"):
    for row in d.get(k, []):
        print(k, {n: v for n, v in row.items() if not isinstance(v, (list, dict))})
' "$f"; echo '```'; }
  done
} > "$RES/summary.md" 2>&1
tar czf "$OUT/results.tgz" -C "$RES" .
cp "$RES/summary.md" "$RES/stages.tsv" "$OUT/"
cat "$RES/stages.tsv"
echo "done in ${SECONDS}s"
