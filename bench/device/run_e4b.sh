#!/usr/bin/env bash
# One device call (< 10 min on an H100): GPU tests, engine microbenchmarks
# (torch and Triton backends) and a text + video sweep against `g4serve serve --preset e4b`.
# Everything lands in $OUT/results.tgz plus the logs. Usage (device tool):
#   run(command="bash bench/device/run_e4b.sh", carry=[".whl"])
set -uo pipefail
source bench/device/setup.sh
RES=/tmp/res
mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/gpu.txt"

# 1. correctness on the GPU
timeout 120 python3 -m pytest -q -m gpu tests/gpu -s -p no:cacheprovider 2>&1 | tee "$RES/gpu_tests.log" | tail -15

# (attention kernel timings: python3 bench/attention_kernels.py --out-dir "$RES" [--q-heads 32 --kv-heads 4])

# 2. engine microbenchmarks, both attention backends
for backend in torch triton; do
  timeout 100 python3 bench/engine_microbench.py --model e4b --device cuda --attention-backend "$backend" \
    --batches 1,8,32 --decode-steps 16 --prefill-reps 3 --out "$RES" --tag="-$backend" 2>&1 | tail -8
done

# 3. server + load generator: text and video sweeps on the e4b preset (Triton backend)
python3 -m g4serve.cli serve --preset e4b --device cuda --port 8100 --attention-backend triton \
  --max-num-seqs 64 > "$RES/server.log" 2>&1 &
SERVER=$!
for i in $(seq 120); do curl -sf localhost:8100/health >/dev/null && break; sleep 1; done
for wl in text video; do
  timeout 80 python3 -m g4serve.cli bench --workload "$wl" --base-url http://127.0.0.1:8100 --rates 1,4 \
    --duration 8 --warmup 8 --drain-timeout 20 --out "$RES/sweep-$wl" --label g4serve-e4b 2>&1 | tail -8
done
kill -INT $SERVER; wait $SERVER
tar czf "$OUT/results.tgz" -C "$RES" .
cp "$RES/gpu_tests.log" "$OUT/" 2>/dev/null
ls -la "$RES"
