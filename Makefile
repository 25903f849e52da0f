# Distributed Shampoo for LibTorch. Two commands on a fresh machine:
#   make demo   install what is missing, build, train a CNN on Fashion-MNIST with Shampoo
#   make test   install what is missing, build, run every test
# Other targets: deps, build, compare, bench, install PREFIX=..., sanitize, clean.
# Overrides: TORCH_VERSION=2.11.0 (the torch wheel from PyPI), TORCH_DIR=<torch root holding
# share/cmake/Torch> (use an existing LibTorch), BUILD_DIR, JOBS, CMAKE_ARGS.

BUILD_DIR ?= build
JOBS ?= $(shell nproc)
PREFIX ?= /usr/local
TORCH_VERSION ?= 2.11.0
CMAKE_ARGS ?=
CTEST_ARGS ?=
export TORCH_VERSION TORCH_DIR
# ccache: precompiled headers need these to hit the cache.
export CCACHE_SLOPPINESS = pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE ?= 5G

DEPS_STAMP := $(BUILD_DIR)/.deps-$(TORCH_VERSION)
CONFIG_STAMP := $(BUILD_DIR)/CMakeCache.txt

.PHONY: all deps configure build test demo compare bench install sanitize clean python python-test

all: build

# Installs Debian packages and LibTorch when missing; remembers where Torch's CMake files are.
$(DEPS_STAMP): scripts/install_deps.sh
	@mkdir -p $(BUILD_DIR)
	bash scripts/install_deps.sh > $(BUILD_DIR)/.torch-cmake-dir.tmp
	tail -n 1 $(BUILD_DIR)/.torch-cmake-dir.tmp > $(BUILD_DIR)/.torch-cmake-dir
	rm -f $(BUILD_DIR)/.torch-cmake-dir.tmp
	touch $@

deps: $(DEPS_STAMP)

$(CONFIG_STAMP): $(DEPS_STAMP)
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release \
	  -DTorch_DIR="$$(cat $(BUILD_DIR)/.torch-cmake-dir)" $(CMAKE_ARGS)

configure: $(CONFIG_STAMP)

build: $(CONFIG_STAMP)
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

# The Python package distributed_shampoo_cpp, built in the build tree ($(BUILD_DIR)/python; the
# line it prints is the PYTHONPATH to use), and its tests (CTest label python). A wheel of it:
# pip install --no-build-isolation . (pyproject.toml; docs/python.md).
python: $(CONFIG_STAMP)
	cmake --build $(BUILD_DIR) -j $(JOBS) --target shampoo_python
	@echo "PYTHONPATH=$(abspath $(BUILD_DIR))/python:$$(dirname $$(sed 's|/share/cmake/Torch$$||' $(BUILD_DIR)/.torch-cmake-dir))"

python-test: $(CONFIG_STAMP)
	cmake --build $(BUILD_DIR) -j $(JOBS) --target shampoo_python cpp_trajectory
	cd $(BUILD_DIR) && ctest --output-on-failure -L python $(CTEST_ARGS)

# Fashion-MNIST with Distributed Shampoo under torchrun, on the GPUs when nvidia-smi lists one,
# else on 2 CPU ranks, then the plot of its metrics (examples/run_demo.sh.in; DEMO_DIR,
# DEMO_RANKS and DEMO_DEVICE override).
# Builds only what it runs: the library and the trainer (not the tests and benchmarks).
demo: $(CONFIG_STAMP)
	cmake --build $(BUILD_DIR) -j $(JOBS) --target cifar10_trainer
	$(BUILD_DIR)/examples/run_demo.sh

# Shampoo against Adam, AdamW and SGD with momentum on three workloads (the demo's ConvNet, the
# deep autoencoder, an LSTM language model on the Penn Treebank), each over an lr grid; CSV, plot
# and Markdown table per workload in $(BUILD_DIR)/compare (examples/run_compare.sh.in: the full
# budget on a GPU, a reduced one on a CPU; COMPARE_WORKLOADS and the other COMPARE_* override).
compare: $(CONFIG_STAMP)
	cmake --build $(BUILD_DIR) -j $(JOBS) --target cifar10_trainer
	$(BUILD_DIR)/examples/run_compare.sh

bench: build
	bash benchmarks/run_all.sh $(BUILD_DIR)

# The multi-rank suites (Gloo route included) under AddressSanitizer and UBSan, in build-asan/.
# LibTorch itself is not instrumented; its process-lifetime allocations are not leak-checked.
sanitize: $(DEPS_STAMP)
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHAMPOO_SANITIZE=address,undefined \
	  -DSHAMPOO_BUILD_EXAMPLES=OFF -DSHAMPOO_BUILD_BENCHMARKS=OFF \
	  -DTorch_DIR="$$(cat $(BUILD_DIR)/.torch-cmake-dir)" $(CMAKE_ARGS)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest -L multirank --output-on-failure

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD_DIR)
