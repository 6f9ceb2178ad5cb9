#!/usr/bin/env bash
# Served text at saturation (issue 23: the served engine completed 4.5k tok/s at 64 QPS while the engine alone
# decodes 10.3k tok/s at B=64). One device call, e4b preset (bf16): start `g4serve serve`, then for each
# rate in RATES an open-loop text sweep (PROMPT in / OUTPUT out tokens) for DURATION s, with the engine's
# counters read from /metrics before and after: steps per second, output tokens per step (the decode batch
# the engine actually ran), prompt tokens per step, and the running / waiting requests at the end.
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/saturation.sh", carry=[".whl"])
# CPU smoke test: SETUP=0 PRESET=tiny DEVICE=cpu BACKEND=torch RATES="2 4" DURATION=3 OUT=/tmp/out bash ...
# Results: $OUT/saturation.tgz (each point's results.json, the metrics snapshots, the server log), the table
# in $OUT/saturation.md.
set -uo pipefail
PRESET=${PRESET:-e4b} DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-triton} OUT=${OUT:-/tmp/out}
RES=${RES:-/tmp/res-saturation} RATES=${RATES:-32 64} PROMPT=${PROMPT:-500} OUTPUT=${OUTPUT:-128}
DURATION=${DURATION:-15} MAX_SEQS=${MAX_SEQS:-64} SERVE_ARGS=${SERVE_ARGS:-}
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh  # SETUP=0: no wheels (CPU smoke test)
# shellcheck disable=SC2086  # SERVE_ARGS: extra flags, split on spaces
python3 -m g4serve.cli serve --preset "$PRESET" --device "$DEVICE" --port 8100 --attention-backend "$BACKEND" \
  --max-num-seqs "$MAX_SEQS" $SERVE_ARGS > "$RES/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do curl -sf localhost:8100/health > /dev/null && break; sleep 1; done
for rate in $RATES; do
  curl -sf localhost:8100/metrics > "$RES/metrics-$rate-before.txt"
  timeout -k 5 $((DURATION + 120)) python3 -m g4serve.cli bench --base-url http://127.0.0.1:8100 \
    --workload text --rates "$rate" --prompt-tokens "$PROMPT" --output-tokens "$OUTPUT" --warmup 4 \
    --duration "$DURATION" --drain-timeout 90 --no-plots --label "text-$rate" --out "$RES/text-$rate" \
    > "$RES/text-$rate.log" 2>&1
  curl -sf localhost:8100/metrics > "$RES/metrics-$rate-after.txt"
done
kill $server
wait $server 2>/dev/null
python3 - "$RES" "$RATES" <<'EOF' | tee "$OUT/saturation.md"
import json, pathlib, re, sys
res, rates = pathlib.Path(sys.argv[1]), sys.argv[2].split()

def metrics(path):
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(g4serve_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out

def total(m, name):
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))

print("| QPS offered | done | req/s | out tok/s | TTFT p50 / p95 ms | ITL p50 / p95 ms | steps/s | out tok / step "
      "| prompt tok / step | running / waiting after |")
print("|---|---:|---:|---:|---|---|---:|---:|---:|---|")
ms = lambda v: "–" if v is None else f"{v * 1e3:.1f}"
for rate in rates:
    p = json.loads((res / f"text-{rate}" / "results.json").read_text())["points"][0]
    before, after = metrics(res / f"metrics-{rate}-before.txt"), metrics(res / f"metrics-{rate}-after.txt")
    steps = total(after, "g4serve_num_steps") - total(before, "g4serve_num_steps")
    decoded = total(after, "g4serve_generation_decoded_tokens") - total(before, "g4serve_generation_decoded_tokens")
    prompt = total(after, "g4serve_prompt_tokens_total") - total(before, "g4serve_prompt_tokens_total")
    wall = p["duration_s"]
    print(f"| {rate} | {p['requests_completed']} | {p['requests_per_s']:.1f} | {p['output_tokens_per_s']:.0f} | "
          f"{ms(p['ttft_p50_s'])} / {ms(p['ttft_p95_s'])} | {ms(p['itl_p50_s'])} / {ms(p['itl_p95_s'])} | "
          f"{steps / wall:.0f} | {decoded / max(steps, 1):.1f} | {prompt / max(steps, 1):.0f} | "
          f"{total(after, 'g4serve_num_requests_running'):.0f} / {total(after, 'g4serve_num_requests_waiting'):.0f} |")
EOF
tar -czf "$OUT/saturation.tgz" -C "$RES" .
