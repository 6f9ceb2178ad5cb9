#!/usr/bin/env bash
# Decode-path A/B in one device call (e4b preset, bf16, H100): the decode GEMM kernels against cuBLAS per
# projection shape (bench/gemv_kernels.py; GEMV_ARGS="--sweep" also searches tiles), then the engine
# microbenchmark with the skinny kernel (default) and without it (G4SERVE_SKINNY_MAX_ROWS=0), decode profiles at
# PROFILE_BATCHES (default 1). ORDER lists the runs: skinny (everything on), cublas (no skinny kernel), rows8 and
# rows64 (the skinny kernel up to 8 or 64 rows, cuBLAS beyond), nopdl (no
# programmatic dependent launch, G4SERVE_PDL=0), sync (no async scheduling: every step read back before the next
# is launched), sampled (decode requests sampling with SAMPLING_ARGS, default temperature 0.8 and top-p 0.9),
# sampled_chunked and sampled_onerow (the same with and without the chunked sampler), tempered and
# tempered_onerow (temperature 1.0 alone, with and without it), sampled_base and skinny_base (the same on the sources in BASE_SRC, an untracked copy
# of an older src/: `git archive <rev> src | tar -x -C .ab-base`, carried; BASE_SRC=.ab-base/src), sampler
# (bench/sampler.py SAMPLER_ARGS), vision (bench/vision_encoder.py --profile, 6 frames of 480p).
# RUN_GEMV=0 skips the kernel table.
#   run(command="G4SERVE_GIT_COMMIT=<git rev-parse HEAD> bash bench/device/decode_ab.sh", carry=[".whl"])
# Everything lands in $OUT/decode_ab.tgz; the tables are in $OUT/summary.md.
set -uo pipefail
PRESET=${PRESET:-e4b} GEMV_ARGS=${GEMV_ARGS:-} RUN_GPU_TESTS=${RUN_GPU_TESTS:-1}
BATCHES=${BATCHES:-1,8,32,64} OUT=${OUT:-/tmp/out} PROFILE_BATCHES=${PROFILE_BATCHES:-1}
ORDER=${ORDER:-skinny cublas} RUN_GEMV=${RUN_GEMV:-1}
RES=${RES:-/tmp/res-ab}  # (under $OUT: the logs come back even if the call is cut)
mkdir -p "$RES" "$OUT"
source bench/device/setup.sh
TAIL_LINES=30
if [ "$RUN_GPU_TESTS" = 1 ]; then
  run gpu_tests "${GPU_TESTS_TIMEOUT:-150}" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -k "${GPU_TESTS_K:-skinny or fused or e4b}"
fi
skinny() {
  run "microbench-skinny${1:-}" 150 python3 bench/engine_microbench.py --model "$PRESET" --device cuda --attention-backend triton \
    --batches "$BATCHES" --decode-steps 16 --prefill-reps 3 --profile-batches "$PROFILE_BATCHES" --out "$RES" --tag="-skinny${1:-}"
}
skinny_base() {  # the same against the sources in BASE_SRC (e.g. an older commit's src/, from git archive)
  PYTHONPATH="$BASE_SRC:$PYTHONPATH" skinny -base
}
cublas() {
  G4SERVE_SKINNY_MAX_ROWS=0 run microbench-cublas 120 python3 bench/engine_microbench.py --model "$PRESET" \
    --device cuda --attention-backend triton --batches "$BATCHES" --decode-steps 16 --prefill-lengths 512 \
    --prefill-reps 3 --out "$RES" --tag=-cublas
}
rows_upto() {  # the skinny kernel up to $1 token rows, cuBLAS beyond
  G4SERVE_SKINNY_MAX_ROWS=$1 run "microbench-rows$1" "${ROWS_TIMEOUT:-150}" python3 bench/engine_microbench.py \
    --model "$PRESET" --device cuda --attention-backend triton --batches "$BATCHES" --decode-steps 16 \
    --prefill-lengths 512 --prefill-reps 3 --out "$RES" --tag="-rows$1"
}
rows8() { rows_upto 8; }
rows64() { rows_upto 64; }
nopdl() {
  G4SERVE_PDL=0 run microbench-nopdl 120 python3 bench/engine_microbench.py --model "$PRESET" \
    --device cuda --attention-backend triton --batches "$BATCHES" --decode-steps 16 --prefill-lengths 512 \
    --prefill-reps 3 --out "$RES" --tag=-nopdl
}
sampled() {  # decode requests that sample (SAMPLING_ARGS) instead of taking the argmax in the graph
  run "microbench-sampled${1:-}" 150 python3 bench/engine_microbench.py --model "$PRESET" --device cuda \
    --attention-backend triton --batches "$BATCHES" --decode-steps 32 --prefill-lengths 512 --prefill-reps 3 \
    ${SAMPLING_ARGS:---temperature 0.8 --top-p 0.9} --out "$RES" --tag="-sampled${1:-}"
}
sampled_base() {  # the same against the sources in BASE_SRC (e.g. an older commit's src/, from git archive)
  PYTHONPATH="$BASE_SRC:$PYTHONPATH" sampled -base
}
sampled_chunked() {  # the same with the chunked sampler on (G4SERVE_CHUNKED_SAMPLING=1) or off
  G4SERVE_CHUNKED_SAMPLING=1 sampled -chunked
}
sampled_onerow() {
  G4SERVE_CHUNKED_SAMPLING=0 sampled -onerow
}
tempered() {  # decode requests at temperature 1.0 alone (the OpenAI API's default), chunked sampler on / off
  G4SERVE_CHUNKED_SAMPLING=1 SAMPLING_ARGS="--temperature 1.0" sampled -temperature
}
tempered_onerow() {
  G4SERVE_CHUNKED_SAMPLING=0 SAMPLING_ARGS="--temperature 1.0" sampled -temperature-onerow
}
sync() {
  run microbench-sync 150 python3 bench/engine_microbench.py --model "$PRESET" --device cuda \
    --attention-backend triton --batches "$BATCHES" --decode-steps 32 --prefill-lengths 512 --prefill-reps 3 \
    --no-async-scheduling --out "$RES" --tag=-sync
}
sampler() {
  # shellcheck disable=SC2086  # SAMPLER_ARGS: several words
  run sampler 120 python3 bench/sampler.py --reps 20 ${SAMPLER_ARGS:-} --out-dir "$RES"
}
vision() {
  run vision 120 python3 bench/vision_encoder.py --model "$PRESET" --device cuda --frames 6 --size 854x480 \
    --no-peer --profile --out "$RES"
}
for step in $ORDER; do $step; done
[ "$RUN_GEMV" = 1 ] && run gemv "${GEMV_TIMEOUT:-300}" python3 bench/gemv_kernels.py --preset "$PRESET" $GEMV_ARGS --out-dir "$RES"
{
  for f in "$RES"/*.log; do echo "## $(basename "$f")"; echo '```'; tail -n 60 "$f"; echo '```'; done
} > "$OUT/summary.md"
tar -czf "$OUT/decode_ab.tgz" -C "$RES" .
