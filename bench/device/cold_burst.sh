#!/usr/bin/env bash
# Is there a cold penalty for the first media burst after start? One device call (e4b preset, bf16): start
# `g4serve serve`, time how long until /health answers, read the GPU memory in use once it does and the
# server's warm-up log lines (vision-encoder frame buckets captured), then send BURSTS bursts of videos (6
# frames of 480p, 10 output tokens) at VIDEO_QPS, each after WARMUP warm-up requests. The first burst against
# the later ones is the cold penalty (issue 23: TTFT p95 1.40 s cold against 179 ms E2E p95 warm, before the
# vision graphs were captured at warm-up).
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/cold_burst.sh", carry=[".whl"])
# CPU smoke test: SETUP=0 PRESET=tiny DEVICE=cpu BACKEND=torch DURATION=3 VIDEO_QPS=2 OUT=/tmp/out bash ...
# Results: $OUT/cold_burst.tgz (results.json of every burst, the server log), the table in $OUT/cold_burst.md.
set -uo pipefail
PRESET=${PRESET:-e4b} DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-triton} OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-cold-burst} VIDEO_QPS=${VIDEO_QPS:-24} WARMUP=${WARMUP:-8} DURATION=${DURATION:-10}
BURSTS=${BURSTS:-2} SERVE_ARGS=${SERVE_ARGS:-}
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh  # SETUP=0: no wheels (CPU smoke test)
start=$SECONDS
# shellcheck disable=SC2086  # SERVE_ARGS: extra flags, split on spaces
python3 -m g4serve.cli serve --preset "$PRESET" --device "$DEVICE" --port 8100 --attention-backend "$BACKEND" \
  --max-num-seqs 64 $SERVE_ARGS > "$RES/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do curl -sf localhost:8100/health > /dev/null && break; sleep 1; done
ready_s=$((SECONDS - start))
memory=$(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "n/a")
for i in $(seq "$BURSTS"); do
  timeout -k 5 $((DURATION + 90)) python3 -m g4serve.cli bench --base-url http://127.0.0.1:8100 \
    --workload video --rates "$VIDEO_QPS" --warmup "$WARMUP" --duration "$DURATION" --drain-timeout 60 \
    --seed "$i" --no-plots --label "burst-$i" --out "$RES/burst-$i" > "$RES/burst-$i.log" 2>&1
done
kill $server
wait $server 2>/dev/null
{
  echo "server ready (/health) after ${ready_s} s; GPU memory used / total once ready: $memory"
  grep -E "warm-up done|vision-encoder graphs|KV cache:" "$RES/server.log" | sed 's/^/    /'
  echo
  echo "| burst | done | TTFT p50 / p95 ms | E2E p50 / p95 ms | server prep / enc ms |"
  echo "|---|---:|---|---|---|"
  python3 - "$RES" <<'EOF'
import json, pathlib, sys
ms = lambda v: "–" if v is None else f"{v * 1e3:.0f}"
for path in sorted(pathlib.Path(sys.argv[1]).glob("burst-*/results.json")):
    for p in json.loads(path.read_text())["points"]:
        server = p.get("server") or {}
        print(f"| {path.parent.name} | {p['requests_completed']} | {ms(p['ttft_p50_s'])} / {ms(p['ttft_p95_s'])} | "
              f"{ms(p['e2e_p50_s'])} / {ms(p['e2e_p95_s'])} | {ms(server.get('prepare_mean_s'))} / "
              f"{ms(server.get('encoder_mean_s'))} |")
EOF
} > "$OUT/cold_burst.md"
cat "$OUT/cold_burst.md"
tar -czf "$OUT/cold_burst.tgz" -C "$RES" .
