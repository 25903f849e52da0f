#!/usr/bin/env bash
# Installs what the build needs and is missing; idempotent, and downloads nothing on a second run.
#   - Debian packages: compiler, CMake, fmt, GoogleTest, Google Benchmark, ccache, gloo headers,
#     zlib, the Fashion-MNIST data set.
#   - LibTorch from the `torch` wheel on PyPI (pinned, TORCH_VERSION overrides), unpacked into
#     DEPS_DIR, plus the three CUDA runtime libraries the wheel loads that the CUDA toolkit in
#     /usr/local/cuda lacks (cuFile, cuSPARSELt, NVSHMEM), so libtorch_cuda.so loads on CPU machines.
#   - Skipped when TORCH_DIR (a folder holding share/cmake/Torch) is given, e.g. the GPU machine's
#     preinstalled python torch.
# Prints the Torch CMake folder on its last line.
set -euo pipefail

TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
DEPS_DIR="${DEPS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/distributed-shampoo}"

log() { printf '[deps] %s\n' "$*" >&2; }

debian_packages=(cmake g++ make libfmt-dev googletest libgtest-dev libgmock-dev libbenchmark-dev
                 ccache libgloo-dev zlib1g-dev dataset-fashion-mnist python3-pip)
install_debian() {
  command -v dpkg-query >/dev/null || { log "not a Debian system; install by hand: ${debian_packages[*]}"; return; }
  local missing=()
  for p in "${debian_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

install_torch() {
  if [ -n "${TORCH_DIR:-}" ]; then
    [ -d "$TORCH_DIR/share/cmake/Torch" ] || { log "TORCH_DIR=$TORCH_DIR has no share/cmake/Torch"; exit 1; }
    echo "$TORCH_DIR/share/cmake/Torch"; return
  fi
  local prefix="$DEPS_DIR/torch-$TORCH_VERSION"
  local stamp="$prefix/.installed"
  if [ ! -f "$stamp" ]; then
    log "installing LibTorch $TORCH_VERSION (torch wheel from PyPI) into $prefix"
    rm -rf "$prefix"; mkdir -p "$prefix"
    # --no-deps: we need the C++ libraries, not the Python stack; the CUDA libraries come from
    # /usr/local/cuda, except the three below, which the toolkit does not ship.
    local extra=()
    case "$TORCH_VERSION" in
      2.11.*) extra=(nvidia-cufile==1.15.1.6 nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5) ;;
    esac
    # pip download + unzip rather than pip install: works with an externally managed python too.
    PIP_ROOT_USER_ACTION=ignore python3 -m pip download --quiet --no-deps -d "$prefix/wheels" \
      "torch==$TORCH_VERSION" "${extra[@]}" >&2
    for wheel in "$prefix"/wheels/*.whl; do
      python3 -m zipfile -e "$wheel" "$prefix" >&2
    done
    rm -rf "$prefix/wheels"
    touch "$stamp"
  fi
  echo "$prefix/torch/share/cmake/Torch"
}

install_debian
install_torch
