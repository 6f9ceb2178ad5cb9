#!/usr/bin/env bash
# The processed-media cache, A/B in one device call (e4b preset, bf16, media on the GPU): for each side in
# SIDES (on: --mm-processor-cache-gb 1, the default; off: 0) start `g4serve serve`, then
#   1. new: videos not seen before (6 x 480p JPEG frames, 10 output tokens) at 1 QPS;
#   2. seen: the same videos again at 1 QPS (the cache's case: a chat turn re-sending its video);
#   3. sweep: new videos at SWEEP QPS (the knee: p95 E2E <= 300 ms);
#   4. on the first side only, text streams (8, 128-token answers) beside new videos at 32 QPS: the engine-side
#      ITL by step kind (server.step_intervals) says which steps make the text streams' p95.
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/media_cache_ab.sh", carry=[".whl"])
# CPU smoke test: SETUP=0 PRESET=tiny DEVICE=cpu BACKEND=torch DURATION=2 SWEEP=1,2 OUT=/tmp/out bash ...
# Results: $OUT/media_cache_ab.tgz (every results.json and server log), the table in $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-triton} OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-cache-ab} SIDES=${SIDES:-on off} DURATION=${DURATION:-8} SWEEP=${SWEEP:-32,48,64} PORT=${PORT:-8200}
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
bench() {  # bench NAME ARGS...: one g4serve bench run against the server, output under $RES/$side/NAME
  timeout -k 5 $((DURATION * 4 + 100)) python3 -m g4serve.cli bench --base-url http://127.0.0.1:$PORT \
    --duration "$DURATION" --drain-timeout 60 --no-plots --label "$side-$1" --out "$RES/$side/$1" "${@:2}" \
    > "$RES/$side/$1.log" 2>&1
}
first=1
for side in $SIDES; do
  mkdir -p "$RES/$side"
  gb=1; [[ $side == off ]] && gb=0
  python3 -m g4serve.cli serve --preset "$PRESET" --device "$DEVICE" --port "$PORT" --attention-backend "$BACKEND" \
    --max-num-seqs 64 --mm-processor-cache-gb $gb > "$RES/$side/server.log" 2>&1 &
  server=$!
  wait_healthy "$PORT" $server 180
  bench new --workload video --rates 1 --warmup 2 --seed 2
  bench seen --workload video --rates 1 --warmup 2 --seed 2
  bench sweep --workload video --rates "$SWEEP" --warmup 4 --seed 3
  if [[ $first == 1 ]]; then
    # The videos start first and outlast the text point by 10 s, so they arrive during all of it.
    bench video-beside --workload video --rates "${SWEEP%%,*}" --warmup 2 --seed 4 --duration $((DURATION + 10)) &
    video=$!
    # the text point starts once the media arrive (their warm-up 2, then 8 of their point): a media bench
    # builds its first ~10 s of bodies before it sends
    python3 -c "import sys; from g4serve.bench.loadgen import wait_for_finished as w; sys.exit(not w('http://127.0.0.1:$PORT', 10))"
    bench text-beside-video --workload text --output-tokens 128 --concurrency 8 --warmup 4
    wait $video
  fi
  first=0
  kill $server; wait $server 2>/dev/null
done
python3 - "$RES" > "$OUT/summary.md" <<'EOF'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
ms = lambda v: "–" if v is None else f"{v * 1e3:.1f}"
print("| side | run | QPS | done / sent | TTFT p50 / p95 ms | E2E p95 ms | ITL p50 / p95 ms | server prepare / preprocess "
      "mean ms | step interval p50 / p95 ms (steps): decode; prefill; encode |")
print("|---|---|---:|---|---|---:|---|---|---|")
for path in sorted(res.glob("*/*/results.json")):
    for p in json.loads(path.read_text())["points"]:
        s = p.get("server") or {}
        steps = "; ".join(f"{ms(r.get('p50_s'))} / {ms(r.get('p95_s'))} ({r['steps']})"
                          for r in (s.get("step_intervals") or {}).values()) or "–"
        print(f"| {path.parent.parent.name} | {path.parent.name} | {p.get('rate_qps') or p.get('concurrency')} | "
              f"{p['requests_completed']} / {p['requests_sent']} | {ms(p['ttft_p50_s'])} / {ms(p['ttft_p95_s'])} | "
              f"{ms(p['e2e_p95_s'])} | {ms(p['itl_p50_s'])} / {ms(p['itl_p95_s'])} | "
              f"{ms(s.get('prepare_mean_s'))} / {ms(s.get('preprocess_mean_s'))} | {steps} |")
EOF
cat "$OUT/summary.md"
tar -czf "$OUT/media_cache_ab.tgz" -C "$RES" .
