#!/usr/bin/env bash
# Runs every benchmark built in <build_dir>: prints their tables and writes their JSON results to
# <build_dir>/benchmarks/results/<name>.json. Arguments after <build_dir> go to every benchmark,
# e.g. `bash benchmarks/run_all.sh build --threads 1 --repetitions 3`.
# BENCHMARKS="bench_a bench_b" runs only those, e.g.
# `BENCHMARKS=bench_virtual_groups bash benchmarks/run_all.sh build-bench --threads 1`.
# `make bench` builds first and then calls this script.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: bash benchmarks/run_all.sh <build_dir> [benchmark arguments...]" >&2
  exit 2
fi
build_dir=$1
shift

read -r -a benchmarks <<< "${BENCHMARKS:-bench_optimizer_step bench_families bench_virtual_groups bench_distributed bench_in_backward bench_gradient_sharding bench_micro}"

# Which sources were measured: the git revision of this checkout, "+dirty" with local changes.
# A --label among the arguments overrides it.
repo=$(cd "$(dirname "$0")/.." && pwd)
label=unknown
if git -C "$repo" rev-parse --short HEAD > /dev/null 2>&1; then
  label=$(git -C "$repo" rev-parse --short HEAD)
  git -C "$repo" diff --quiet HEAD -- . ':!benchmarks' 2> /dev/null || label="$label+dirty"
fi
results="$build_dir/benchmarks/results"
mkdir -p "$results"

for name in "${benchmarks[@]}"; do
  exe="$build_dir/benchmarks/$name"
  if [[ ! -x "$exe" ]]; then
    echo "run_all.sh: $exe is missing; configure with -DSHAMPOO_BUILD_BENCHMARKS=ON and build" \
         "the target $name (cmake --build $build_dir --target $name)" >&2
    exit 1
  fi
  json="$results/${name#bench_}.json"
  echo "== $name $*"
  start=$SECONDS
  "$exe" --json "$json" --label "$label" "$@"
  echo "== $name: $((SECONDS - start)) s, results in $json"
  echo
done
