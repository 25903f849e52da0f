#!/usr/bin/env bash
# The GPU check and figures in one time-boxed call, for a short device lease (15 minutes of device
# time, machine start included). Prepare here with scripts/device_bundle.sh, then
#   run(command="bash scripts/device_lease.sh", carry=[".device"], timeout_s=580)
# In priority order, each stage bounded so the whole ends before LEASE_SECONDS (540):
#   1. build everything (the build stage of scripts/device_check.sh: tests, examples, benchmarks)
#   2. every test labelled cuda (verbose: which cases ran, which skipped)
#   3. scripts/device_perf.sh stages "ours reference bench_cuda" with a short window and the
#      solvers in LEASE_SOLVERS (eigh and the fastest setting of the last run by default)
# $OUT receives machine.txt, build.log, ctest_cuda.log, summary.md, results.json, logs.tar.gz
# (the device tool brings back at most 8 files). The last lines printed are the test summary and
# the performance table.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/device-out}"
BUILD="${BUILD:-/tmp/shampoo-build-gpu}"
LEASE_SECONDS="${LEASE_SECONDS:-540}"
SOLVERS="${LEASE_SOLVERS:-eigh,coupled-newton-tf32,newton-db-tf32}"
mkdir -p "$OUT"
log() { printf '[device_lease %(%H:%M:%S)T +%ds] %s\n' -1 "$SECONDS" "$*"; }
left() { echo $((LEASE_SECONDS - SECONDS)); }

log "build"
STAGES=build OUT="$OUT" BUILD="$BUILD" JOBS="$(nproc)" bash scripts/device_check.sh \
  > "$OUT/build_stage.txt" 2>&1
rc=$?
log "build: exit $rc"
cat "$OUT/machine.txt" 2>/dev/null
if [ "$rc" -ne 0 ]; then
  grep -E "error" "$OUT/build.log" | head -n 40
  tail -n 20 "$OUT/build_stage.txt"
  exit 1
fi

log "ctest -L cuda ($(left) s left)"
budget=$(( $(left) - 200 )); [ "$budget" -gt 240 ] && budget=240; [ "$budget" -lt 60 ] && budget=60
(cd "$BUILD" && timeout "$budget" ctest -L cuda -j 4 -V --timeout "$budget") \
  > "$OUT/ctest_cuda.log" 2>&1
rc=$?
log "ctest -L cuda: exit $rc"
echo "gtest cases passed: $(grep -c '\[ *OK *\]' "$OUT/ctest_cuda.log" || true)"
grep -E "\[ *(FAILED|SKIPPED) *\] [A-Za-z]|tests passed|tests failed|\((Failed|Timeout)\)|Test *#.*(Passed|Failed|Timeout|Skipped)" \
  "$OUT/ctest_cuda.log" | head -n 60

if [ "$(left)" -lt 90 ]; then log "no time left for the figures"; exit "$rc"; fi
per_stage=$(( $(left) / 5 )); [ "$per_stage" -gt 150 ] && per_stage=150
log "figures, ${per_stage} s per benchmark run"
PERF_STAGES="ours reference bench_cuda" PERF_SOLVERS="$SOLVERS" PERF_WINDOW=20 PERF_WINDOWS=2 \
  PERF_F1_STEPS=3 PERF_STAGE_TIMEOUT="$per_stage" OUT="$OUT" BUILD="$BUILD" \
  bash scripts/device_perf.sh
perf=$?
log "done (tests exit $rc, figures exit $perf)"
exit $(( rc != 0 || perf != 0 ))
