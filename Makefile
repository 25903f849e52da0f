# Distributed Shampoo for LibTorch. Two commands on a fresh machine:
#   make demo   install what is missing, build, train a CNN on Fashion-MNIST with Shampoo
#   make test   install what is missing, build, run every test
# Other targets: deps, build, bench, install PREFIX=..., clean.
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

.PHONY: all deps configure build test demo bench install clean

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

demo: build
	$(BUILD_DIR)/examples/fashion_mnist_demo

bench: build
	bash benchmarks/run_all.sh $(BUILD_DIR)

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD_DIR)
