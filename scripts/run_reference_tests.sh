#!/usr/bin/env bash
# Runs test modules of the reference implementation (facebookresearch/optimizers) with its
# DistributedShampoo replaced by this package's: code no one here wrote, testing us.
#
#   scripts/run_reference_tests.sh REFERENCE_CHECKOUT [--cpu] MODULE [MODULE ...]
#
# REFERENCE_CHECKOUT: a checkout (or `git archive`) of the reference; it is not changed: a scratch
# copy gets one line appended to distributed_shampoo/distributed_shampoo.py that swaps the class
# for distributed_shampoo_cpp.DistributedShampoo. The reference's config classes and test helpers
# are used as they are. MODULE: a dotted test module, e.g.
# distributed_shampoo.gpu_tests.shampoo_grafting_test. --cpu: in the modules named after it, CUDA
# devices become the CPU and their "needs CUDA" skips are dropped (for GPU-only test classes that
# run on Gloo as well). Needs the package on PYTHONPATH (`make python` prints it) and the
# reference's test dependency expecttest (installed into the scratch folder if missing).
# Prints each module's unittest summary; exit status 1 if any test failed.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
reference=$1
shift
[[ -f "$reference/distributed_shampoo/distributed_shampoo.py" ]] || {
  echo "run_reference_tests: $reference has no distributed_shampoo/distributed_shampoo.py" >&2
  exit 2
}
python3 -c "import distributed_shampoo_cpp" 2>/dev/null || {
  echo "run_reference_tests: distributed_shampoo_cpp does not import; put the PYTHONPATH that" \
       "'make python' prints in the environment" >&2
  exit 2
}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r "$reference" "$scratch/reference"
cat >> "$scratch/reference/distributed_shampoo/distributed_shampoo.py" <<'PY'

from distributed_shampoo_cpp import DistributedShampoo  # noqa: E402,F811 (run_reference_tests.sh)
PY
deps=""
if ! python3 -c "import expecttest" 2>/dev/null; then
  echo "run_reference_tests: installing expecttest into the scratch folder"
  python3 -m pip install -q --target "$scratch/deps" expecttest
  deps="$scratch/deps"
fi
export PYTHONPATH="$scratch/reference${PYTHONPATH:+:$PYTHONPATH}${deps:+:$deps}"
swapped=$(cd "$scratch/reference" && python3 -c "
from distributed_shampoo.distributed_shampoo import DistributedShampoo
print(DistributedShampoo.__module__)" 2>/dev/null | tail -n 1)
[[ $swapped == distributed_shampoo_cpp.* ]] || {
  echo "run_reference_tests: the reference's DistributedShampoo is not swapped ($swapped)" >&2
  exit 2
}
cpu=0
status=0
for module in "$@"; do
  if [[ $module == --cpu ]]; then
    cpu=1
    continue
  fi
  if ((cpu)); then
    file="$scratch/reference/${module//.//}.py"
    sed -i -e 's/torch\.device("cuda")/torch.device("cpu")/g' -e 's/"cuda"/"cpu"/g' \
           -e 's/^\(\s*\)@unittest\.skipIf(not torch\.cuda\.is_available().*$/\1pass/' \
           -e 's/^\(\s*\)@skip_if_lt_x_gpu([0-9]*)$//' "$file"
    # A decorator line replaced by "pass" above may only precede a class: drop those lines.
    sed -i -e '/^pass$/d' "$file"
  fi
  echo "== $module"
  log="$scratch/$module.log"
  if (cd "$scratch/reference" && python3 -m unittest "$module") >"$log" 2>&1; then
    tail -n 3 "$log"
  else
    status=1
    grep -E '^(FAIL|ERROR): ' "$log" | sed 's/ (.*//' | sort | uniq -c || true
    tail -n 3 "$log"
  fi
done
exit $status
