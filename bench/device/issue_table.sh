#!/usr/bin/env bash
# Issue 23's table in one device call, this commit against the one before (bench/issue_table.py: four jobs,
# one GPU each). Make the before tree first, here:
#   mkdir -p build && git archive <sha> src bench | gzip > build/base.tgz && echo <sha> > build/BASE_COMMIT
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/issue_table.sh",
#       carry=[".whl", "build/base.tgz", "build/BASE_COMMIT"], kind="nvidia-h200-x4")
# On one or two GPUs: SIDES=before, then SIDES=now in a second call on the same warm machine (one GPU: each
# side ~460 s, the served job then the engine job, the 31B load last); merge both tgz locally and run
# `python bench/issue_table.py --table-only --out DIR`. Base: the issue's commit bf14778 (`git archive bf14778
# src bench`, then repack without bench/results: 307 KB). Results: $OUT/issue_table.tgz (every run's JSON and
# log), the table in $OUT/issue_table.md.
set -uo pipefail
OUT=${OUT:-/tmp/out} SIDES=${SIDES:-before,now} DEADLINE=${DEADLINE:-560}
RES=/tmp/res-issue-table
rm -rf "$RES" /tmp/base
mkdir -p "$RES" "$OUT" /tmp/base
source bench/device/setup.sh
if [ -f build/base.tgz ]; then
  tar -xzf build/base.tgz -C /tmp/base
  cp build/BASE_COMMIT /tmp/base/COMMIT 2>/dev/null || true
fi
base=$([ -d /tmp/base/src ] && echo --base /tmp/base || echo "")
# shellcheck disable=SC2086  # base: empty or two words
python3 bench/issue_table.py $base --sides "$SIDES" --deadline "$DEADLINE" --out "$RES" > "$RES/issue_table.log" 2>&1
echo "exit $?"
cp "$RES/issue_table.md" "$OUT/" 2>/dev/null
tail -n 30 "$RES/issue_table.log"
tar -czf "$OUT/issue_table.tgz" -C "$RES" .
