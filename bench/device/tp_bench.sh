#!/usr/bin/env bash
# Issue 25 in one device call on nvidia-h200-x2 (2 GPUs of one host): tensor parallel and replicas on real GPUs.
#   0. NCCL with CUDA graphs across both GPUs: the TP engine stops in seconds and starts again (a GPU test)
#   1. 31b bf16 at TP 2: decode ITL at B = 1/8/32/64, TTFT at 512/2048 tokens, and a batch-1 profile of rank 0
#      (the NCCL kernels' time per step against the link's bandwidth) (bench/engine_microbench.py)
#   2. e4b as 2 replicas (one GPU each) behind `g4serve router`: a text sweep at rising QPS through the router
#      (with the router's CPU time), the router's placements, the sweep's first point replayed (the same
#      requests: the replicas' prefix hits show what affinity keeps), then one replica alone (throughput ratio)
#   3. the link: all-reduce bus bandwidth, NCCL, 2 ranks (bench/allreduce_bw.py)
#   4. 31b bf16, greedy tokens at TP 2 against TP 1 on the same random weights (bench/tp_parity.py; TP 1 fits
#      one H200), with each size's start-up time
# STAGES (default "0 1 2 3 4") picks the stages to run, e.g. STAGES="0 2 4" when 1 and 3 were measured before.
# Each stage runs under its share of DEADLINE seconds, in that order (what the issue needs most first), packed
# into $OUT/tp_bench.tgz after each stage (a device call brings back at most 8 files), so a call cut short
# still brings back every finished stage. NVLink multicast stays off (KINDS.md): the variables are exported
# here as well, so every process started below inherits them.
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/tp_bench.sh", carry=[".whl"],
#       kind="nvidia-h200-x2", timeout_s=600)
# CPU smoke test (gloo, the tiny model; figures meaningless):
#   SETUP=0 DEVICE=cpu MODEL=tiny REPLICA_MODEL=tiny BACKEND=torch RATES=2,4 DURATION=3 OUT=/tmp/out bash ...
# Results: $OUT/tp_bench.tgz (every JSON and log), the tables in $OUT/tp_bench.md.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-31b} REPLICA_MODEL=${REPLICA_MODEL:-e4b} BACKEND=${BACKEND:-triton}
RATES=${RATES:-24,48,96,144} DURATION=${DURATION:-10} DEADLINE=${DEADLINE:-570} OUT=${OUT:-/tmp/out}
DECODE_STEPS=${DECODE_STEPS:-24} PREFILL_REPS=${PREFILL_REPS:-3} STAGES=" ${STAGES:-0 1 2 3 4} "
RES=/tmp/res-tp-bench
rm -rf "$RES"
mkdir -p "$RES" "$OUT"
pack() { tar -czf "$OUT/tp_bench.tgz" -C "$RES" .; }  # after every stage: a call cut short keeps what finished
source bench/device/setup.sh
model_arg=$([ "$MODEL" = tiny ] && echo "" || echo "--model $MODEL")
stage() { [[ $STAGES == *" $1 "* ]]; }  # is stage $1 asked for
left() { echo $(( (DEADLINE - SECONDS) * $1 / 100 )); }  # a share of the seconds left

# 0. NCCL across the two GPUs with CUDA graphs: the engine stops in seconds and starts again (the tiny model)
# (-s -v and the fault handler: a hang shows where each thread waits)
stage 0 && run nccl-stop-start "$(left 20)" python3 -m pytest -s -v -m gpu tests/gpu/test_tensor_parallel_gpu.py -k nccl \
  -p no:cacheprovider -o faulthandler_timeout=100

# 1. 31b at TP 2: decode ITL, TTFT, a batch-1 profile of rank 0 (the NCCL kernels' time per step)
# shellcheck disable=SC2086  # model_arg: empty or two words
stage 1 && run microbench-tp2 "$(left 40)" python3 bench/engine_microbench.py $model_arg --device "$DEVICE" \
  --attention-backend "$BACKEND" --tensor-parallel-size 2 --batches 1,8,32,64 --decode-steps "$DECODE_STEPS" \
  --prefill-lengths 512,2048 --prefill-reps "$PREFILL_REPS" --profile --out "$RES"
pack

# 2. e4b: two replicas behind the router, then one replica alone
serve() {  # serve PORT GPU
  CUDA_VISIBLE_DEVICES=$2 python3 -m g4serve.cli serve --preset "$REPLICA_MODEL" --device "$DEVICE" \
    --attention-backend "$BACKEND" --port "$1" --max-num-seqs 128 > "$RES/replica-$1.log" 2>&1 &
}
if stage 2; then
serve 8101 0
replica1=$!
serve 8102 1
replica2=$!
python3 -m g4serve.cli router --port 8100 --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102 \
  > "$RES/router.log" 2>&1 &
router=$!
while [ $SECONDS -lt $((DEADLINE / 2)) ]; do
  curl -sf localhost:8101/health > /dev/null && curl -sf localhost:8102/health > /dev/null && break
  sleep 1
done
for _ in $(seq 30); do curl -sf localhost:8100/health > /dev/null && break; sleep 1; done
sweep() {  # sweep NAME URL
  timeout -k 5 "$(left 30)" python3 -m g4serve.cli bench --base-url "$2" --workload text --rates "$RATES" \
    --prompt-tokens 500 --output-tokens 128 --duration "$DURATION" --warmup 4 --drain-timeout 60 --no-plots \
    --label "$1" --out "$RES/$1" > "$RES/$1.log" 2>&1
}
cpu_s() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }  # a process's CPU seconds (USER_HZ 100)
router_cpu0=$(cpu_s $router)
sweep two-replicas http://127.0.0.1:8100
awk -v a="$(cpu_s $router)" -v b="$router_cpu0" \
  'BEGIN {printf "router CPU during the two-replica sweep: %.1f s\n", a - b}' | tee "$RES/router-cpu.txt"
curl -sf localhost:8100/metrics > "$RES/router-metrics.txt"
for port in 8101 8102; do curl -sf "localhost:$port/metrics" > "$RES/replica-$port-metrics.txt"; done
# The sweep's first point again (same seed, same requests): what affinity buys is the replay's prefix hits
(RATES=${RATES%%,*} sweep replay http://127.0.0.1:8100)
for port in 8101 8102; do curl -sf "localhost:$port/metrics" > "$RES/replica-$port-metrics-replay.txt"; done
sweep one-replica http://127.0.0.1:8101
kill $router $replica1 $replica2
wait 2>/dev/null
pack
fi

# 3. the link: all-reduce bus bandwidth over NCCL, 2 ranks; 4. greedy tokens at TP 2 against TP 1
stage 3 && run allreduce "$(left 25)" python3 bench/allreduce_bw.py --world-size 2 --device "$DEVICE" --out "$RES"
pack
# shellcheck disable=SC2086
stage 4 && run parity "$(left 95)" python3 bench/tp_parity.py $model_arg --sizes 2,1 --device "$DEVICE" --max-tokens 32 \
  --out "$RES"
pack

python3 - "$RES" <<'EOF' | tee "$OUT/tp_bench.md"
import json, pathlib, re, sys
res = pathlib.Path(sys.argv[1])
def newest(pattern):
    found = sorted(res.glob(pattern))
    return json.loads(found[-1].read_text()) if found else None
ar = newest("allreduce-*.json")
if ar:
    print("All-reduce, 2 ranks:\n\n| bytes | time (us) | busbw (GB/s) |\n|---:|---:|---:|")
    for r in ar["rows"]:
        print(f"| {r['bytes']:,} | {r['time_us']:.1f} | {r['busbw_gb_s']:.1f} |")
par = newest("tp-parity-*.json")
if par:
    base, other = list(par["tokens"])[:2]
    def prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    same = [prefix(a, b) for a, b in zip(par["tokens"][base], par["tokens"][other])]
    print(f"\nGreedy tokens, TP {other} against TP {base} (leading tokens equal, per prompt): {same}; "
          f"start-up {par['startup_s']}")
mb = newest("microbench-*.json")
if mb:
    print(f"\nDecode at TP {mb.get('tensor_parallel_size')} ({mb.get('model')}):\n\n| batch | ITL p50 (ms) |\n|---:|---:|")
    for d in mb["decode"]:
        print(f"| {d.get('batch')} | {d.get('itl_p50_ms')} |")
    for pr in mb["prefill"]:
        print(f"prefill {pr.get('prompt_tokens')}: TTFT p50 {pr.get('ttft_p50_ms')} ms")
for name in ("two-replicas", "one-replica"):
    path = res / name / "results.json"
    if path.exists():
        print(f"\n{name}:\n\n| QPS | done | out tok/s | TTFT p95 ms | ITL p50 ms |\n|---:|---:|---:|---:|---:|")
        for p in json.loads(path.read_text())["points"]:
            ttft = p["ttft_p95_s"] * 1e3 if p["ttft_p95_s"] is not None else float("nan")
            itl = p["itl_p50_s"] * 1e3 if p["itl_p50_s"] is not None else float("nan")
            print(f"| {p.get('rate_qps')} | {p['requests_completed']} | {p['output_tokens_per_s']:.0f} | {ttft:.1f} | {itl:.1f} |")
cpu = res / "router-cpu.txt"
if cpu.exists():
    print("\n" + cpu.read_text().strip())
metrics = res / "router-metrics.txt"
if metrics.exists():
    print("\nRouter placements:")
    for line in metrics.read_text().splitlines():
        if re.match(r"^g4serve_router_requests_total", line):
            print("    " + line)
def counters(path):  # prompt and prefix-hit token totals of one replica's /metrics
    out = {"prompt": 0.0, "hit": 0.0}
    for line in path.read_text().splitlines() if path.exists() else []:
        for key, name in (("prompt", "g4serve_prompt_tokens_total"), ("hit", "g4serve_prefix_cache_hit_tokens_total")):
            if line.startswith(name):
                out[key] += float(line.split()[-1])
    return out
for port in (8101, 8102):
    before, after = counters(res / f"replica-{port}-metrics.txt"), counters(res / f"replica-{port}-metrics-replay.txt")
    line = f"\nreplica {port}: sweep {before['hit']:.0f} of {before['prompt']:.0f} prompt tokens from the prefix cache"
    if after["prompt"] > before["prompt"]:
        share = (after["hit"] - before["hit"]) / (after["prompt"] - before["prompt"])
        line += f"; replay of the first point: {share:.1%} of {after['prompt'] - before['prompt']:.0f}"
    print(line)
EOF
