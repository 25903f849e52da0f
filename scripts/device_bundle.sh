#!/usr/bin/env bash
# Prepares, on a development machine with apt, what the GPU machine of the `device` tool lacks for
# a build of this project (it reaches no package registry): the Debian packages of GoogleTest,
# Google Benchmark, CLI11, nlohmann-json, the gloo headers and zlib, downloaded into .device/debs (ignored by git). Then one device call:
#   run(command="bash scripts/device_check.sh", carry=[".device"])
# scripts/device_check.sh unpacks them there, builds with that machine's PyTorch and nvcc, runs
# the tests and the GPU benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(googletest libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian libcli11-dev
          nlohmann-json3-dev libgloo-dev zlib1g zlib1g-dev)
mkdir -p .device/debs
rm -f .device/debs/*.deb
# apt-get download writes into the current folder; as root it warns that _apt cannot write there.
(cd .device/debs && apt-get download "${packages[@]}" 2>&1 | grep -v "unsandboxed" >&2 || true)
for p in "${packages[@]}"; do
  compgen -G ".device/debs/${p}_*.deb" >/dev/null || { echo "device_bundle: ${p} not downloaded" >&2; exit 1; }
done
du -sh .device/debs | sed 's/^/device_bundle: /'
