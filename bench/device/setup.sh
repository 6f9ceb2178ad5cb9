# Source at the start of a device command: installs the carried wheels (.whl/, or .whl-gpu/ when that smaller
# set is what was carried) into /tmp/site without touching the image's torch, and puts g4serve's sources on
# the path, with Hugging Face libraries kept offline. SETUP=0 (a CPU smoke test of the
# device scripts, in an environment that already has the dependencies) skips the wheels.
if [ "${SETUP:-1}" = 1 ]; then
  WHEELS=${WHEELS:-$([ -d .whl ] && echo .whl || echo .whl-gpu)}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing outside the device machine can be reached
# run NAME SECONDS CMD...: CMD under a timeout, its output in $RES/NAME.log (the caller sets RES), the exit
# status and elapsed time appended, the last $TAIL_LINES lines (default 20) echoed.
run() {
  local name=$1 secs=$2 t0=$SECONDS
  shift 2
  echo "== $name"
  timeout -k 5 "$secs" "$@" > "$RES/$name.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" | tee -a "$RES/$name.log"
  tail -n "${TAIL_LINES:-20}" "$RES/$name.log"
}
# second_gpu: the GPU for a half of the work run beside GPU 0 (1; 0 on a one-GPU machine: the caller then
# runs its halves in turn).
second_gpu() { python3 -c "import torch; print(1 if torch.cuda.device_count() >= 2 else 0)"; }
# wait_healthy PORT PID SECONDS: until the server on PORT answers /health (0), or process PID has exited or
# SECONDS have passed (1).
wait_healthy() {
  local end=$(( SECONDS + $3 ))
  while (( SECONDS < end )); do
    curl -sf "localhost:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
# pack NAME LINES [HEADER]: $OUT/summary.md (HEADER, then the last LINES lines of each $RES/*.log) and every
# result under $RES in $OUT/NAME.tgz.
pack() {
  {
    [ -n "${3:-}" ] && echo "$3"
    for f in "$RES"/*.log; do echo "## $(basename "$f")"; echo '```'; tail -n "$2" "$f"; echo '```'; done
  } > "$OUT/summary.md"
  tar -czf "$OUT/$1.tgz" -C "$RES" .
}
# gpu_tests [SECONDS]: pytest -m gpu on the paths of $GPU_TESTS, -k $GPU_TESTS_K, when GPU_TESTS is set
# ($RES/gpu-tests.log; SECONDS default $TESTS_TIMEOUT, else 120).
gpu_tests() {
  [ -z "${GPU_TESTS:-}" ] && return 0
  # shellcheck disable=SC2086  # GPU_TESTS: several paths
  run gpu-tests "${1:-${TESTS_TIMEOUT:-120}}" python3 -m pytest -q -m gpu $GPU_TESTS -k "${GPU_TESTS_K:-}"
}
