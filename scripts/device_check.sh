#!/usr/bin/env bash
# The GPU check, on the device machine (prepare with scripts/device_bundle.sh, carry .device):
# unpacks the carried Debian packages, builds with the machine's own PyTorch (python3) and nvcc
# for Hopper, runs every test (the `cuda` label verbosely) and bench_cuda. Logs and the
# benchmark's JSON go to $OUT (./device-out when unset).
#   STAGES="build test bench" (default all), JOBS (default nproc), BENCH_ARGS (extra bench_cuda
#   flags), BUILD (default /tmp/shampoo-build-gpu), BUILD_TARGETS (default: everything; the build
#   stage needs tests/preconditioners/preconditioners_tests among them). scripts/device_perf.sh runs the build
#   stage of this script.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-out}"
STAGES="${STAGES:-build test bench}"
JOBS="${JOBS:-$(nproc)}"
BUILD="${BUILD:-/tmp/shampoo-build-gpu}"
mkdir -p "$OUT"
log() { printf '[device_check %(%H:%M:%S)T] %s\n' -1 "$*"; }
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }

log "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -n 1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$OUT/machine.txt"

if has_stage build; then
  root=/tmp/shampoo-devroot
  rm -rf "$root"; mkdir -p "$root"
  compgen -G ".device/debs/*.deb" >/dev/null || { log "no .device/debs: run scripts/device_bundle.sh here and carry .device"; exit 1; }
  for deb in .device/debs/*.deb; do
    case "$deb" in */zlib1g*) continue ;; esac
    dpkg-deb -x "$deb" "$root"
  done
  extra=()
  if [ ! -f /usr/include/zlib.h ]; then
    # The machine's zlib has no headers: the carried ones and the static library (the carried
    # libz.so points at a Debian path that does not exist there).
    for deb in .device/debs/zlib1g*.deb; do dpkg-deb -x "$deb" "$root"; done
    extra+=(-DZLIB_INCLUDE_DIR="$root/usr/include"
            -DZLIB_LIBRARY="$root/usr/lib/x86_64-linux-gnu/libz.a")
  fi
  torch_prefix="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
  log "configure (torch CMake files in $torch_prefix)"
  cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$root/usr;$torch_prefix" -DSHAMPOO_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 -DSHAMPOO_USE_PCH=ON \
    "${extra[@]}" 2>&1 | tee "$OUT/configure.log" | grep -E "DistributedShampoo|Error|error" || true
  targets=()
  # shellcheck disable=SC2206
  [ -n "${BUILD_TARGETS:-}" ] && targets=(--target ${BUILD_TARGETS})
  log "build with $JOBS jobs${BUILD_TARGETS:+ (targets: $BUILD_TARGETS)}"
  set -o pipefail
  # Keep going past a target that fails, so that one broken test binary leaves the rest to run.
  keep_going=(); [ ${#generator[@]} -gt 0 ] && keep_going=(-- -k 0)
  cmake --build "$BUILD" -j "$JOBS" "${targets[@]}" "${keep_going[@]}" 2>&1 | tee "$OUT/build.log" \
    | grep -E "error|warning" || true
  [ -x "$BUILD/tests/preconditioners/preconditioners_tests" ] || { log "build failed, see build.log"; exit 1; }
fi

status=0
if has_stage test; then
  log "tests labelled cuda, verbose"
  (cd "$BUILD" && ctest -L cuda -V --timeout 600) > "$OUT/ctest_cuda.log" 2>&1 || status=1
  echo "gtest cases passed: $(grep -c '\[ *OK *\]' "$OUT/ctest_cuda.log" || true)"
  grep -E "\[ *(FAILED|SKIPPED) *\] [A-Za-z]|tests passed|tests failed" "$OUT/ctest_cuda.log" || true
  log "all tests"
  (cd "$BUILD" && ctest -j 8 --output-on-failure --timeout 600) > "$OUT/ctest_all.log" 2>&1 || status=1
  tail -n 20 "$OUT/ctest_all.log"
fi

if has_stage bench; then
  log "bench_cuda"
  # shellcheck disable=SC2086
  "$BUILD/benchmarks/bench_cuda" --json "$OUT/bench_cuda.json" \
    --label "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_cuda.log" || status=1
fi
log "done, status $status"
exit "$status"
