#!/usr/bin/env bash
# The GPU checks and figures in time-boxed calls, for a short device lease (15 minutes of device
# time, machine start included). Prepare here with scripts/device_bundle.sh, then
#   run(command="bash scripts/device_lease.sh", carry=[".device"], timeout_s=580)
# LEASE_STAGES picks the stages, run in the order given, each bounded so that the whole ends before
# LEASE_SECONDS (540); a later call on the still-warm machine reuses the build in $BUILD (the
# build stage then only relinks what changed):
#   build       everything (the build stage of scripts/device_check.sh: tests, examples, benchmarks)
#   test        every test labelled cuda (verbose: which cases ran, which skipped)
#   perf        scripts/device_perf.sh stages "ours reference bench_cuda", a short window, the
#               solvers in LEASE_SOLVERS (eigh and the fastest setting of the last run by default)
#   experiment  eigh on the transformer workload at f=20 and f=1 under the settings in
#               LEASE_EXPERIMENTS ("name:bench_transformer flags;..."): time and peak by setting;
#               LEASE_ROUNDS (1) times over the list, alternating, for A/B medians
#   profile     bench_transformer --profile-steps: the plain step's device time by kernel (LibTorch's
#               Kineto profiler) and its matmul floor, for the settings in LEASE_PROFILE_SOLVERS
#               (eigh,eigendecomposed by default), with LEASE_PROFILE_FLAGS added (e.g.
#               "--factor-chunk-mb 32")
#   convnet     bench_cuda --sections training: the CIFAR-10 ConvNet step against Adam's, and make
#               compare's Fashion-MNIST ConvNet with the trainer's optimizers, plain and root steps
#               timed apart for each factor dtype, with Kineto profiles (LEASE_BENCH_FLAGS added);
#               then bench_step_ops --device cuda: ATen operators per plain step, profiled
#   demo        the demo (run_demo.sh) on the GPU
#   compare     make compare on the GPU, the full budget (run_compare.sh)
# Default stages: "build test perf". $OUT receives at most 8 files: machine.txt, ctest_cuda.log,
# summary.md, results.json, logs.tar.gz (perf); experiments.txt; profile.txt; demo.txt; compare.md, compare.csv,
# compare.txt; convnet.txt. The last lines printed summarize each stage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/device-out}"
BUILD="${BUILD:-/tmp/shampoo-build-gpu}"
LEASE_SECONDS="${LEASE_SECONDS:-540}"
STAGES="${LEASE_STAGES:-build test perf}"
SOLVERS="${LEASE_SOLVERS:-eigh,coupled-newton-tf32,newton-db-tf32}"
EXPERIMENTS="${LEASE_EXPERIMENTS:-default:;batched chunks 64 MiB:--amortize-chunk-mb 64 --cuda-eigh batched-chunks;batched chunks 32 MiB:--cuda-eigh batched-chunks;amortize 16 MiB:--amortize-chunk-mb 16;amortize 16 MiB, step 32 MiB:--amortize-chunk-mb 16 --step-chunk-mb 32}"
DATA=/tmp/shampoo-devroot/usr/share/datasets/fashion-mnist
mkdir -p "$OUT"
log() { printf '[device_lease %(%H:%M:%S)T +%ds] %s\n' -1 "$SECONDS" "$*"; }
left() { echo $((LEASE_SECONDS - SECONDS)); }
status=0

stage_build() {
  STAGES=build OUT="$OUT" BUILD="$BUILD" JOBS="$(nproc)" bash scripts/device_check.sh \
    > "$OUT/build_stage.txt" 2>&1
  local rc=$?
  log "build: exit $rc"
  cat "$OUT/machine.txt" 2>/dev/null
  if [ "$rc" -ne 0 ]; then
    grep -E "error" "$OUT/build.log" | head -n 40
    tail -n 20 "$OUT/build_stage.txt"
    exit 1
  fi
  rm -f "$OUT/build.log" "$OUT/configure.log" "$OUT/build_stage.txt"
}

stage_test() {
  local budget=$(( $(left) - 60 )); [ "$budget" -gt 240 ] && budget=240
  [ "$budget" -lt 60 ] && budget=60
  (cd "$BUILD" && timeout "$budget" ctest -L cuda -j 4 -V --timeout "$budget") \
    > "$OUT/ctest_cuda.log" 2>&1
  local rc=$?
  log "ctest -L cuda: exit $rc"
  echo "gtest cases passed: $(grep -c '\[ *OK *\]' "$OUT/ctest_cuda.log" || true)"
  grep -E "\[ *(FAILED|SKIPPED) *\] [A-Za-z]|tests passed|tests failed|\((Failed|Timeout)\)|Test *#.*(Passed|Failed|Timeout|Skipped)" \
    "$OUT/ctest_cuda.log" | head -n 60
  [ "$rc" -eq 0 ] || status=1
}

stage_perf() {
  if [ "$(left)" -lt 90 ]; then log "perf: no time left"; status=1; return; fi
  local per_stage=$(( $(left) / 5 )); [ "$per_stage" -gt 150 ] && per_stage=150
  log "perf: ${per_stage} s per benchmark run"
  PERF_STAGES="ours reference bench_cuda" PERF_SOLVERS="$SOLVERS" PERF_WINDOW=20 PERF_WINDOWS=2 \
    PERF_F1_STEPS=3 PERF_STAGE_TIMEOUT="$per_stage" OUT="$OUT" BUILD="$BUILD" \
    bash scripts/device_perf.sh || status=1
}

# One bench_transformer run per setting: eigh, f=20 (2 windows of 20 steps) and f=1 (3 steps).
stage_experiment() {
  local IFS=';' entry round
  read -r -a entries <<< "$EXPERIMENTS"
  for ((round = 1; round <= ${LEASE_ROUNDS:-1}; round++)); do
  for entry in "${entries[@]}"; do
    local name="${entry%%:*}" flags="${entry#*:}"
    local budget=$(( $(left) - 30 ))
    if [ "$budget" -lt 40 ]; then log "experiment '$name': no time left"; status=1; break; fi
    [ "$budget" -gt 120 ] && budget=120
    echo "### $name: $flags" >> "$OUT/experiments.txt"
    IFS=' ' read -r -a extra <<< "$flags"
    timeout "$budget" "$BUILD/benchmarks/bench_transformer" --device cuda --solvers eigh \
      --frequency 20 --window 20 --repetitions 2 --steps 3 --epsilon 1e-8 "${extra[@]}" \
      >> "$OUT/experiments.txt" 2>&1 || status=1
    log "experiment '$name': $(grep -E '^\| eigh' "$OUT/experiments.txt" | tail -n 1)"
  done
  done
}

stage_profile() {
  local budget=$(( $(left) - 20 ))
  if [ "$budget" -lt 40 ]; then log "profile: no time left"; status=1; return; fi
  [ "$budget" -gt 180 ] && budget=180
  timeout "$budget" "$BUILD/benchmarks/bench_transformer" --device cuda \
    --solvers "${LEASE_PROFILE_SOLVERS:-eigh,eigendecomposed}" --frequency 20 --window 20 \
    --repetitions 1 --steps 0 --epsilon 1e-8 --profile-steps 10 ${LEASE_PROFILE_FLAGS:-} \
    > "$OUT/profile.txt" 2>&1 || status=1
  log "profile: $(grep -E '^matmul floor|device busy' "$OUT/profile.txt" | tr '\n' ' ')"
}

stage_convnet() {
  local budget=$(( $(left) - 20 ))
  if [ "$budget" -lt 40 ]; then log "convnet: no time left"; status=1; return; fi
  [ "$budget" -gt 240 ] && budget=240
  # shellcheck disable=SC2086
  timeout "$budget" "$BUILD/benchmarks/bench_cuda" --sections training --repetitions 3 \
    ${LEASE_BENCH_FLAGS:-} > "$OUT/convnet.txt" 2>&1 || status=1
  timeout 60 "$BUILD/benchmarks/bench_step_ops" --device cuda --steps 5 --profile 1 \
    >> "$OUT/convnet.txt" 2>&1 || status=1
  log "convnet:"
  grep -E "ms/step|ms per iteration|plain iteration|ATen operators per step" "$OUT/convnet.txt"
}

stage_demo() {
  local budget=$(( $(left) - 20 ))
  if [ "$budget" -lt 40 ]; then log "demo: no time left"; status=1; return; fi
  DEMO_DIR=/tmp/shampoo-demo timeout "$budget" "$BUILD/examples/run_demo.sh" --data-dir "$DATA" \
    > "$OUT/demo.txt" 2>&1 || status=1
  log "demo: $(grep -iE "accuracy|seconds|error" "$OUT/demo.txt" | tail -n 3 | tr '\n' ' ')"
}

stage_compare() {
  local budget=$(( $(left) - 15 ))
  if [ "$budget" -lt 60 ]; then log "compare: no time left"; status=1; return; fi
  rm -rf /tmp/shampoo-compare
  COMPARE_DEVICE=cuda COMPARE_DIR=/tmp/shampoo-compare timeout "$budget" \
    "$BUILD/examples/run_compare.sh" --data-dir "$DATA" > "$OUT/compare.txt" 2>&1 || status=1
  log "compare: exit status so far $status"
  tail -n 30 "$OUT/compare.txt"
  for f in /tmp/shampoo-compare/compare.md /tmp/shampoo-compare/compare.csv; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
}

for stage in $STAGES; do
  log "$stage ($(left) s left)"
  case "$stage" in
    build | test | perf | experiment | profile | convnet | demo | compare) "stage_$stage" ;;
    *) log "unknown stage '$stage' (build test perf experiment profile convnet demo compare)"; exit 2 ;;
  esac
done
log "done, status $status"
exit "$status"
