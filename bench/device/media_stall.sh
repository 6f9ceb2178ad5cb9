#!/usr/bin/env bash
# Do media arrivals stall running decodes? One device call (e4b preset, bf16): for each server mode in
# MODES (insteps: encoders inside the step, media prepared on the host; overlap: --overlap-encoder;
# gpumedia: --media-on-gpu, images and frames decoded and resized on the GPU, the default on CUDA since
# 7e78d66; capped: steps with decodes give prefills at most PREFILL_CAP tokens, default 512; all but
# gpumedia and split pass --no-media-on-gpu, so each differs from insteps in one thing; splitE or splitEpP:
# gpumedia with at most E soft tokens encoded in a step beside decodes, a video a few frames a step (and
# at most P prefill tokens beside them), e.g. split140p256; gpuoverlap or gpuoverlapP (e.g. gpuoverlap256): gpumedia with the encoder on
# its side stream (--overlap-encoder; and at most P prefill tokens beside decodes); gilN: the default (gpumedia on CUDA) with the switch
# interval of the interpreter lock at N microseconds (G4SERVE_GIL_SWITCH_INTERVAL_US; Python: 5000); mp4: gpumedia
# with the videos sent as one H.264 MP4 each (--video-format mp4, MP4_FRAMES frames at 30 fps, default 6: the
# JPEG videos' encoder work), decoded by the host's FFmpeg; nvdec: the same MP4s decoded by NVDEC
# (--video-decoder nvdec; carry .whl-nvdec instead of .whl)), start
# `g4serve serve`, then
#   1. text alone: CONCURRENCY closed-loop streams of TEXT_OUTPUT-token answers to ~500-token prompts;
#   2. the same text streams while videos (6 frames of 480p, 10 output tokens) arrive at VIDEO_QPS.
# The text streams' ITL p50/p95/p99 in 2 against 1 is what an encode costs the decodes running beside it.
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/media_stall.sh", carry=[".whl"])
# PROFILE=1: then, text alone and text beside videos once more, each with PROFILE_S (2) seconds of torch.profiler
# on the engine thread (POST /start_profile, /stop_profile): the traces and ops tables under $RES/<mode>/profile/,
# their host time by thread and function (bench/trace_summary.py, whole and inside the engine's phases) in
# $RES/<mode>/profiled-*.md.
# CPU smoke test: SETUP=0 PRESET=tiny DEVICE=cpu BACKEND=torch DURATION=3 MODES=insteps OUT=/tmp/out bash ...
# Results: $OUT/media_stall.tgz (every results.json and server log), the table in $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-triton} OUT=${OUT:-/tmp/out} RES=${RES:-/tmp/res-stall}
MODES=${MODES:-insteps overlap} CONCURRENCY=${CONCURRENCY:-8} TEXT_OUTPUT=${TEXT_OUTPUT:-128}
PROFILE=${PROFILE:-0} PROFILE_S=${PROFILE_S:-2} VIDEO_QPS=${VIDEO_QPS:-4} DURATION=${DURATION:-12} MEDIA=${MEDIA:-video} PREFILL_CAP=${PREFILL_CAP:-512} PORT=${PORT:-8100}
MP4_FRAMES=${MP4_FRAMES:-6}
mkdir -p "$RES" "$OUT"
[[ " $MODES " == *" nvdec "* ]] && export WHEELS=${WHEELS:-.whl-nvdec}  # the nvdec mode's carry set
source bench/device/setup.sh  # SETUP=0: no wheels (CPU smoke test)
bench() {  # bench NAME ARGS...: one g4serve bench run against the server, output under $RES/$mode/NAME
  local t0=$SECONDS
  timeout -k 5 $((DURATION + 70)) python3 -m g4serve.cli bench --base-url http://127.0.0.1:$PORT \
    --duration "$DURATION" --drain-timeout 30 --no-plots --label "$mode-$1" --out "$RES/$mode/$1" "${@:2}" \
    > "$RES/$mode/$1.log" 2>&1
  local rc=$?
  echo "   $mode $1: exit $rc after $((SECONDS - t0)) s"  # progress, for a call that runs out of time
  [[ $rc == 124 ]] && stacks  # timed out
}
stacks() {  # every server thread's Python stack into its log (g4serve serve on SIGUSR1); the last dump's busy ones
  kill -USR1 "$server" 2> /dev/null && sleep 2 && echo "   $mode: the server's threads:" && python3 - "$RES/$mode/server.log" <<'EOF'
import sys
dump = open(sys.argv[1], errors="replace").read().rsplit("--- stacks of", 1)[-1]
for thread in dump.split("\nThread ")[1:]:
    lines = thread.splitlines()
    if "in _worker" not in "".join(lines[-2:]):  # an idle pool worker: skipped
        print("   Thread " + "\n   ".join(lines if len(lines) <= 13 else lines[:1] + lines[-12:]))
EOF
}
# Text beside media starts once the media arrive (their warm-up 2, then 8 of their point): a media bench builds
# its first ~10 s of bodies before it sends.
media_arrived() {
  local t0=$SECONDS
  if python3 -c "import sys; from g4serve.bench.loadgen import wait_for_finished as w; sys.exit(not w('http://127.0.0.1:$PORT', 10, 60))"; then
    echo "   $mode: the media arrived after $((SECONDS - t0)) s"
  else
    echo "   $mode: 10 media requests did not finish in 60 s; the server log ends:"; tail -n 5 "$RES/$mode/server.log"
    # Is the GPU busy (a kernel that runs on) or idle (a stream waiting for what never comes)? And the engine's
    # counts: steps, requests running and waiting, KV in use.
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2> /dev/null | sed 's/^/   GPU: /'
    curl -sf "localhost:$PORT/metrics" | grep -E "^g4serve_(num_requests|num_steps|kv_cache_usage|num_overlapped)" \
      | grep -v _bucket | head -n 20 | sed 's/^/   /'
    sleep 2; nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader 2> /dev/null | sed 's/^/   GPU 2 s later: /'
    stacks
    return 1
  fi
}
TEXT=(--workload text --output-tokens "$TEXT_OUTPUT" --concurrency "$CONCURRENCY" --warmup 4)
# MEDIA=audio: clips instead of videos. The media start first and outlast the text point by 10 s (its
# calibration and warm-up take a few seconds), so they arrive during all of it.
VIDEO=(--workload "$MEDIA" --rates "$VIDEO_QPS" --warmup 2 --duration $((DURATION + 10)))
profiled() {  # profiled NAME: the text streams, PROFILE_S seconds of them profiled into $RES/$mode/NAME.json
  bench "$1" "${TEXT[@]}" &
  local text=$!
  sleep 4  # the text streams' calibration and warm-up
  curl -sf -X POST localhost:$PORT/start_profile > /dev/null; sleep "$PROFILE_S"
  curl -sf -X POST localhost:$PORT/stop_profile > "$RES/$mode/$1.json"
  wait $text
  local trace
  trace=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['trace'])" "$RES/$mode/$1.json")
  for focus in "" "): _launch" "): _encode" "): _collect_encodes" "): _complete"; do  # host time by function
    python3 bench/trace_summary.py "$trace" --top 40 ${focus:+--focus "$focus"} --min-busy-ms 20
  done > "$RES/$mode/$1.md" 2>&1
}
summarize() {  # the table of every mode done so far, into $OUT/summary.md
  python3 - "$RES" > "$OUT/summary.md" <<'EOF'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
print("| mode | run | done | TTFT p50 / p95 ms | ITL p50 / p95 / p99 ms | out tok/s | server prep / enc ms "
      "| engine ITL p50 / p95 / p99 ms | loop lag p50 / p99 ms "
      "| engine thread ms a step: host / of it on CPU / wait (steps) "
      "| step interval p50 / p95 ms (steps): decode; prefill; encode |")
print("|---|---|---:|---|---|---:|---|---|---|---|---|")
ms = lambda v: "–" if v is None else f"{v * 1e3:.1f}"
def thread(server):  # the engine thread's phases (engine/step_profile.py): all but waiting on the device
    phases = server.get("engine_thread_ms_per_step") or {}
    cpu = server.get("engine_thread_cpu_ms_per_step") or {}
    host = sum(v for k, v in phases.items() if k != "wait")
    on_cpu = sum(v for k, v in cpu.items() if k != "wait")
    return f"{host:.2f} / {on_cpu:.2f} / {phases['wait']:.2f} ({server['engine_steps']})" if "wait" in phases else "–"
def intervals(server):  # the engine-side ITL by what the step carried (engine/step_profile.py)
    rows = server.get("step_intervals") or {}
    return "; ".join(f"{ms(r.get('p50_s'))} / {ms(r.get('p95_s'))} ({r['steps']})" for r in rows.values()) or "–"
def quantiles(server, key, qs):
    return " / ".join(ms(server.get(f"{key}_p{q}_s")) for q in qs)
for path in sorted(res.glob("*/*/results.json")):
    for p in json.loads(path.read_text())["points"]:
        server = p.get("server") or {}
        print(f"| {path.parent.parent.name} | {path.parent.name} | {p['requests_completed']} | "
              f"{ms(p['ttft_p50_s'])} / {ms(p['ttft_p95_s'])} | {ms(p['itl_p50_s'])} / {ms(p['itl_p95_s'])} / "
              f"{ms(p['itl_p99_s'])} | {p['output_tokens_per_s']:.0f} | "
              f"{ms(server.get('prepare_mean_s'))} / {ms(server.get('encoder_mean_s'))} | "
              f"{quantiles(server, 'server_itl', (50, 95, 99))} | {quantiles(server, 'event_loop_lag', (50, 99))} | "
              f"{thread(server)} | {intervals(server)} |")
EOF
}
for mode in $MODES; do
  mkdir -p "$RES/$mode"
  case $mode in
    overlap) extra="--overlap-encoder --no-media-on-gpu" ;;
    gpumedia) extra=--media-on-gpu ;;
    capped) extra="--max-prefill-tokens-beside-decodes $PREFILL_CAP --no-media-on-gpu" ;;
    split*)  # splitE[pP]: media on the GPU, at most E soft tokens encoded beside decodes (and P prefill tokens)
      spec=${mode#split}
      extra="--media-on-gpu --max-encoder-tokens-beside-decodes ${spec%%p*}"
      [[ $spec == *p* ]] && extra+=" --max-prefill-tokens-beside-decodes ${spec#*p}" ;;
    gpuoverlap*)  # gpuoverlap[P]: media on the GPU, encoded on the side stream (and at most P prefill tokens)
      extra="--media-on-gpu --overlap-encoder"
      [[ -n ${mode#gpuoverlap} ]] && extra+=" --max-prefill-tokens-beside-decodes ${mode#gpuoverlap}" ;;
    gil*) extra= ;;  # the default: media on the GPU where the engine runs on CUDA
    mp4) extra= ;;
    nvdec) extra="--video-decoder nvdec" ;;
    *) extra=--no-media-on-gpu ;;
  esac
  fmt=(); [[ $mode == mp4 || $mode == nvdec ]] && fmt=(--video-format mp4 --num-frames "$MP4_FRAMES")
  switch=; [[ $mode == gil* ]] && switch=${mode#gil}  # empty: Python's default
  profile_dir=; [[ $PROFILE == 1 ]] && profile_dir=$RES/$mode/profile
  G4SERVE_TORCH_PROFILER_DIR=$profile_dir G4SERVE_GIL_SWITCH_INTERVAL_US=$switch python3 -m g4serve.cli serve --preset "$PRESET" --device "$DEVICE" --port "$PORT" --attention-backend "$BACKEND" \
    --max-num-seqs 64 $extra > "$RES/$mode/server.log" 2>&1 &
  server=$!
  t0=$SECONDS
  if ! wait_healthy "$PORT" $server 180; then
    echo "== $mode: not ready after $((SECONDS - t0)) s; the server log ends:"; tail -n 20 "$RES/$mode/server.log"
    kill $server 2> /dev/null; wait $server 2>/dev/null; continue
  fi
  echo "== $mode: ready after $((SECONDS - t0)) s"
  bench text-alone "${TEXT[@]}"
  bench video-beside "${VIDEO[@]}" "${fmt[@]}" --seed 1 &
  video=$!
  if ! media_arrived; then  # a stuck server: no text point beside media it does not serve; the next mode
    kill $server; wait $server 2>/dev/null; wait $video; summarize; continue
  fi
  bench text-beside-video "${TEXT[@]}"
  wait $video
  if [[ $PROFILE == 1 ]]; then  # after the timed runs (the profiler slows the steps): PROFILE_S seconds of each
    profiled profiled-text-alone
    bench profiled-videos "${VIDEO[@]}" "${fmt[@]}" --seed 2 &
    video=$!
    media_arrived
    profiled profiled-text-beside-video
    wait $video
  fi
  kill $server; wait $server 2>/dev/null
  summarize  # so far: a call that runs out of time keeps the modes done
done
summarize
cat "$OUT/summary.md"
tar -czf "$OUT/media_stall.tgz" -C "$RES" .
