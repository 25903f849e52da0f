#!/usr/bin/env bash
# The GPU performance figures of issue 13, in one call of the `device` tool (prepare with
# scripts/device_bundle.sh, carry .device):
#   run(command="bash scripts/device_perf.sh", carry=[".device"])
# Stages, each timed and logged:
#   build      the build stage of scripts/device_check.sh (the targets below only)
#   ctest      the tests labelled cuda (summary lines)
#   ours       bench_transformer, every solver setting, frequency PERF_FREQUENCY and 1; then the
#              one-group-per-tensor variant for eigh and the fastest setting (frequency N only)
#   reference  benchmarks/reference_transformer.py on .device/reference: eigh and coupled
#              Newton, then the one-group-per-tensor variant (frequency N only)
#   bench_cuda roots, elementwise chain, ConvNet step
# The last thing printed is one table (benchmarks/transformer_summary.py). $OUT (./device-out
# when unset) receives summary.md, results.json (every JSON result) and logs.tar.gz (every log);
# the device tool brings back at most 8 files.
# Settings (environment): PERF_STAGES (default "build ctest ours reference bench_cuda"),
# PERF_FREQUENCY (20), PERF_WINDOW (40 steps), PERF_WINDOWS (2 windows), PERF_F1_STEPS (5),
# PERF_SOLVERS (every setting), PERF_EPSILON (Shampoo's epsilon, both sides; 1e-8),
# PERF_STAGE_TIMEOUT (seconds per benchmark run, 240), PERF_DEVICE (cuda), PERF_ARGS (more flags for
# both programs), BUILD (/tmp/shampoo-build-gpu), JOBS. Defaults keep the call near 6 to 9 minutes
# on one H100. A CPU dry run of the plumbing, with a build in build/:
#   PERF_STAGES="ours reference" PERF_DEVICE=cpu PERF_ARGS="--small --threads 1" PERF_WINDOW=4 \
#     PERF_FREQUENCY=2 PERF_F1_STEPS=1 PERF_WINDOWS=1 BUILD=build OUT=/tmp/perf \
#     bash scripts/device_perf.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/device-out}"
BUILD="${BUILD:-/tmp/shampoo-build-gpu}"
STAGES="${PERF_STAGES:-build ctest ours reference bench_cuda}"
FREQUENCY="${PERF_FREQUENCY:-20}"
WINDOW="${PERF_WINDOW:-40}"
WINDOWS="${PERF_WINDOWS:-2}"
F1_STEPS="${PERF_F1_STEPS:-5}"
SOLVERS="${PERF_SOLVERS:-eigh,coupled-newton,newton-db,newton-db-tf32,coupled-newton-tf32}"
EPSILON="${PERF_EPSILON:-1e-8}"
DEVICE="${PERF_DEVICE:-cuda}"
read -r -a EXTRA <<< "${PERF_ARGS:-}"
STAGE_TIMEOUT="${PERF_STAGE_TIMEOUT:-240}"
LOGS=/tmp/shampoo-perf-logs
rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
LABEL="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
started=$SECONDS
log() { printf '[device_perf %(%H:%M:%S)T +%ds] %s\n' -1 $((SECONDS - started)) "$*"; }
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
status=0

# run_logged NAME COMMAND...: runs the command under the stage timeout, output to $LOGS/NAME.log;
# prints its last line and how long it took.
run_logged() {
  local name=$1; shift
  local begin=$SECONDS rc=0
  timeout "$STAGE_TIMEOUT" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  [ "$rc" -eq 124 ] && echo "(stopped after ${STAGE_TIMEOUT} s: PERF_STAGE_TIMEOUT)" >> "$LOGS/$name.log"
  log "$name: exit $rc in $((SECONDS - begin)) s"
  [ "$rc" -eq 0 ] || { status=1; tail -n 5 "$LOGS/$name.log"; }
}

finish() {
  log "summary"
  python3 benchmarks/transformer_summary.py --ours "$LOGS/ours.json" \
    --ours-groups "$LOGS/ours_groups.json" --reference "$LOGS/reference.json" \
    --reference-groups "$LOGS/reference_groups.json" --bench-cuda "$LOGS/bench_cuda.json" \
    --markdown "$OUT/summary.md" > "$LOGS/summary.txt" 2>&1 || status=1
  python3 - "$LOGS" "$OUT/results.json" <<'EOF' || status=1
import glob, json, os, sys
logs, out = sys.argv[1], sys.argv[2]
merged = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{logs}/*.json"))}
json.dump(merged, open(out, "w"), indent=1)
EOF
  tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
  log "done in $((SECONDS - started)) s, status $status; logs in logs.tar.gz"
  cat "$LOGS/summary.txt"
  exit "$status"
}

if has_stage build; then
  begin=$SECONDS
  # The build stage of device_check.sh (packages carried in .device, the machine's PyTorch and
  # nvcc), only what this script runs.
  STAGES=build OUT="$LOGS" BUILD="$BUILD" \
    BUILD_TARGETS="preconditioners_tests parallel_tests update_tests shampoo_tests amp_tests bench_transformer bench_cuda" \
    bash scripts/device_check.sh > "$LOGS/device_check_build.log" 2>&1
  rc=$?
  log "build: exit $rc in $((SECONDS - begin)) s"
  grep -E "^[^[].*(error|Error)" "$LOGS/device_check_build.log" | head -n 20
  head -n 3 "$LOGS/machine.txt" 2>/dev/null
  [ "$rc" -eq 0 ] || { status=1; tail -n 20 "$LOGS/device_check_build.log"; finish; }
fi

if has_stage ctest; then
  begin=$SECONDS
  (cd "$BUILD" && ctest -L cuda --timeout 300 --output-on-failure) > "$LOGS/ctest_cuda.log" 2>&1 || status=1
  log "ctest -L cuda: $((SECONDS - begin)) s"
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$LOGS/ctest_cuda.log" || true
fi

bench="$BUILD/benchmarks/bench_transformer"
common=(--device "$DEVICE" --frequency "$FREQUENCY" --window "$WINDOW" --repetitions "$WINDOWS"
        --epsilon "$EPSILON" "${EXTRA[@]}")
if has_stage ours; then
  run_logged ours "$bench" --solvers "$SOLVERS" "${common[@]}" --steps "$F1_STEPS" \
    --json "$LOGS/ours.json" --label "$LABEL"
  # The fastest setting at frequency N (eigh when nothing else finished).
  fastest=$(python3 -c '
import json, sys
try:
    rows = [s for s in json.load(open(sys.argv[1]))["solvers"] if not s.get("error")]
    print(min(rows, key=lambda s: s["amortized_ms"])["name"])
except Exception:
    print("eigh")' "$LOGS/ours.json")
  groups_solvers=eigh; [ "$fastest" != eigh ] && groups_solvers="eigh,$fastest"
  run_logged ours_groups "$bench" --solvers "$groups_solvers" "${common[@]}" \
    --steps 0 --one-group-per-tensor --json "$LOGS/ours_groups.json" --label "$LABEL"
fi

if has_stage reference; then
  if [ -f .device/reference/distributed_shampoo/__init__.py ]; then
    # shellcheck disable=SC2054  # the comma belongs to the --root-inv value
    ref=(env PYTHONUNBUFFERED=1 python3 benchmarks/reference_transformer.py
         --reference-path .device/reference --root-inv eigh,coupled-newton "${common[@]}"
         --label "reference $(cut -c1-12 .device/reference/REVISION 2>/dev/null)")
    run_logged reference "${ref[@]}" --steps "$F1_STEPS" --json "$LOGS/reference.json"
    run_logged reference_groups "${ref[@]}" --steps 0 --one-group-per-tensor \
      --json "$LOGS/reference_groups.json"
  else
    log "reference: .device/reference missing (run scripts/device_bundle.sh here first); skipped"
    status=1
  fi
fi

if has_stage bench_cuda; then
  run_logged bench_cuda "$BUILD/benchmarks/bench_cuda" --json "$LOGS/bench_cuda.json" \
    --label "$LABEL"
fi

finish
