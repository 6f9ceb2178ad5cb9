#!/usr/bin/env bash
# Where a new video's time before the engine goes (issue 23's "<= 5 ms before the engine" row), one device
# call (e4b preset, bf16): for each side in SIDES (gpu: media on the GPU, the default on CUDA; host:
# --no-media-on-gpu; base: gpu on the sources in BASE_SRC, an older commit's src/ carried as in
# decode_ab.sh, for a before-and-after on one machine) start `g4serve serve` with the torch profiler's
# routes, then
#   1. new: videos not seen before (6 x 480p JPEG frames, 10 output tokens) at RATE (1) QPS: the client's TTFT
#      and the server's prepare time split into its stages (g4serve_request_stage_time_seconds: read, parse,
#      render, admit; preprocess: tokens and media; the rest is waiting);
#   2. profiled: new videos at PROFILE_RATE (4) QPS with PROFILE_S (4) seconds of torch.profiler on every
#      thread: the host time by thread and function (bench/trace_summary.py) in $RES/<side>/profiled.md.
# and once (PREPROCESS=1, the default), bench/preprocess_media.py --device cuda: the same request's
# preparation outside the server.
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/prepare_split.sh", carry=[".whl"])
# CPU smoke test: SETUP=0 PRESET=tiny DEVICE=cpu BACKEND=torch SIDES=host DURATION=3 OUT=/tmp/out bash ...
# Results: $OUT/prepare_split.tgz (results.json, logs, the profile summaries; no traces), $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-triton} OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-prepare} SIDES=${SIDES:-gpu host} DURATION=${DURATION:-10} RATE=${RATE:-1}
PROFILE_RATE=${PROFILE_RATE:-4} PROFILE_S=${PROFILE_S:-4} PORT=${PORT:-8300} PREPROCESS=${PREPROCESS:-1}
BASE_SRC=${BASE_SRC:-.ab-base/src}
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
bench() {  # bench NAME ARGS...: one g4serve bench run against the server, output under $RES/$side/NAME
  timeout -k 5 $((DURATION * 3 + 60)) python3 -m g4serve.cli bench --base-url http://127.0.0.1:$PORT \
    --workload video --duration "$DURATION" --drain-timeout 30 --no-plots --label "$side-$1" \
    --out "$RES/$side/$1" "${@:2}" > "$RES/$side/$1.log" 2>&1
  echo "   $side $1: exit $?"
}
for side in $SIDES; do
  mkdir -p "$RES/$side/profile"
  media=--media-on-gpu; [[ $side == host ]] && media=--no-media-on-gpu
  path=$PYTHONPATH; [[ $side == base ]] && path=$BASE_SRC:$PYTHONPATH
  PYTHONPATH=$path G4SERVE_TORCH_PROFILER_DIR=$RES/$side/profile python3 -m g4serve.cli serve --preset "$PRESET" \
    --device "$DEVICE" --port "$PORT" --attention-backend "$BACKEND" $media > "$RES/$side/server.log" 2>&1 &
  server=$!
  if ! wait_healthy "$PORT" $server 180; then
    echo "== $side: not ready; the server log ends:"; tail -n 20 "$RES/$side/server.log"
    kill $server 2> /dev/null; wait $server 2> /dev/null; continue
  fi
  bench new --rates "$RATE" --warmup 2 --seed 2
  # the profiled point: its bodies take a few seconds to build before the first is sent
  bench profiled --rates "$PROFILE_RATE" --warmup 2 --seed 3 &
  load=$!
  python3 -c "import sys; from g4serve.bench.loadgen import wait_for_finished as w; sys.exit(not w('http://127.0.0.1:$PORT', 4, 60))"
  curl -sf -X POST localhost:$PORT/start_profile > /dev/null; sleep "$PROFILE_S"
  curl -sf -X POST localhost:$PORT/stop_profile > "$RES/$side/profiled.json"
  wait $load
  trace=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['trace'])" "$RES/$side/profiled.json")
  for focus in "" "): create" "): process_prompt" "): validate"; do  # host time by function
    python3 bench/trace_summary.py "$trace" --top 40 ${focus:+--focus "$focus"} --min-busy-ms 5
  done > "$RES/$side/profiled.md" 2>&1
  kill $server; wait $server 2> /dev/null
done
if [[ $DEVICE == cuda && $PREPROCESS == 1 ]]; then
  timeout -k 5 180 python3 bench/preprocess_media.py --device cuda --reps 20 --out-dir "$RES/preprocess" \
    > "$RES/preprocess.log" 2>&1
  tail -n 30 "$RES/preprocess.log"
fi
python3 - "$RES" > "$OUT/summary.md" <<'EOF'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
ms = lambda v: "–" if v is None else f"{v * 1e3:.1f}"
stages = ("read", "parse", "render", "preprocess", "admit")
print("| side | run | QPS | done / sent | TTFT p50 / p95 ms | server prepare mean ms | " + " | ".join(stages)
      + " | waiting (the rest) |")
print("|---|---|---:|---|---|---:|" + "---:|" * (len(stages) + 1))
for path in sorted(res.glob("*/*/results.json")):
    for p in json.loads(path.read_text())["points"]:
        s = p.get("server") or {}
        parts = [s.get("preprocess_mean_s") if k == "preprocess" else s.get(f"stage_{k}_mean_s") for k in stages]
        rest = s["prepare_mean_s"] - sum(v or 0.0 for v in parts) if s.get("prepare_mean_s") else None
        print(f"| {path.parent.parent.name} | {path.parent.name} | {p.get('rate_qps')} | "
              f"{p['requests_completed']} / {p['requests_sent']} | {ms(p['ttft_p50_s'])} / {ms(p['ttft_p95_s'])} | "
              f"{ms(s.get('prepare_mean_s'))} | " + " | ".join(ms(v) for v in parts) + f" | {ms(rest)} |")
EOF
cat "$OUT/summary.md"
tar -czf "$OUT/prepare_split.tgz" --exclude='*.trace.json.gz' -C "$RES" .
