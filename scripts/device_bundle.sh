#!/usr/bin/env bash
# Prepares, on a development machine with apt, what the GPU machine of the `device` tool lacks for
# a build of this project (it reaches no package registry): the Debian packages of GoogleTest,
# Google Benchmark, CLI11, nlohmann-json, the gloo headers, zlib and Fashion-MNIST (31 MB; for the
# trainer, make demo and make compare there: --data-dir <unpacked>/usr/share/datasets/fashion-mnist),
# downloaded into .device/debs
# (ignored by git); and the reference Python implementation's `distributed_shampoo` package,
# exported from a local git copy of facebookresearch/optimizers (REFERENCE_GIT, a bare or normal
# repository; REFERENCE_REV, default HEAD) into .device/reference, for
# benchmarks/reference_transformer.py. Then one device call:
#   run(command="bash scripts/device_check.sh", carry=[".device"])   tests and bench_cuda
#   run(command="bash scripts/device_perf.sh", carry=[".device"])    the GPU performance figures
# Both unpack the packages there and build with that machine's PyTorch and nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(googletest libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian libcli11-dev
          nlohmann-json3-dev libgloo-dev zlib1g zlib1g-dev dataset-fashion-mnist)
mkdir -p .device/debs
rm -f .device/debs/*.deb
# apt-get download writes into the current folder; as root it warns that _apt cannot write there.
(cd .device/debs && apt-get download "${packages[@]}" 2>&1 | grep -v "unsandboxed" >&2 || true)
for p in "${packages[@]}"; do
  compgen -G ".device/debs/${p}_*.deb" >/dev/null || { echo "device_bundle: ${p} not downloaded" >&2; exit 1; }
done
du -sh .device/debs | sed 's/^/device_bundle: /'

# The reference implementation: its package only (it imports nothing else of its repository;
# torch and numpy are on the GPU machine).
REFERENCE_GIT="${REFERENCE_GIT:-/work/.mirror/facebookresearch+optimizers/repo}"
REFERENCE_REV="${REFERENCE_REV:-HEAD}"
rm -rf .device/reference
if git -C "$REFERENCE_GIT" rev-parse --verify -q "$REFERENCE_REV^{commit}" >/dev/null 2>&1; then
  mkdir -p .device/reference
  git -C "$REFERENCE_GIT" archive "$REFERENCE_REV" distributed_shampoo | tar -x -C .device/reference
  git -C "$REFERENCE_GIT" rev-parse "$REFERENCE_REV^{commit}" > .device/reference/REVISION
  [ -f .device/reference/distributed_shampoo/__init__.py ] || { echo "device_bundle: no distributed_shampoo package in $REFERENCE_GIT" >&2; exit 1; }
  echo "device_bundle: reference $(cut -c1-12 .device/reference/REVISION) in .device/reference ($(du -sh .device/reference | cut -f1))"
else
  echo "device_bundle: no git copy of facebookresearch/optimizers at $REFERENCE_GIT (set REFERENCE_GIT);" \
       "scripts/device_perf.sh will skip the reference" >&2
fi
du -sh .device | sed 's/^/device_bundle: carried in all /'
