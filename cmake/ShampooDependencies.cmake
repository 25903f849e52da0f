# LibTorch (from the torch wheel, see scripts/install_deps.sh), fmt, CUDA libraries, and what the
# examples and benchmarks use: CLI11 (flags), nlohmann-json (benchmark results), Google Benchmark
# (micro-benchmarks).

# TorchConfig probes the CUDA toolkit itself; keep its messages but not its warnings about
# CMAKE_CUDA_ARCHITECTURES (we set those for our own kernels).
# TORCH_CUDA_ARCH_LIST set: no GPU probing (there may be no GPU on the build machine).
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
# `pip install .` (pyproject.toml): the torch that pip builds against, asked from its Python.
if(SHAMPOO_TORCH_FROM_PYTHON AND NOT Torch_DIR)
  find_package(Python3 COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE shampoo_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE shampoo_torch_found)
  if(NOT shampoo_torch_found EQUAL 0)
    message(FATAL_ERROR "torch is not importable by ${Python3_EXECUTABLE}: install torch first, "
                        "then build with pip install --no-build-isolation .")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${shampoo_torch_prefix}")
endif()
find_package(Torch REQUIRED)

# The imported `torch` target brings libtorch (CPU + CUDA when the wheel has it). Collect the
# pieces we link explicitly.
get_filename_component(SHAMPOO_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(SHAMPOO_TORCH_ROOT "${SHAMPOO_TORCH_LIB_DIR}" DIRECTORY)
message(STATUS "DistributedShampoo: LibTorch at ${SHAMPOO_TORCH_ROOT}")

# Whether this LibTorch was built with CUDA (libtorch_cuda / libc10_cuda present).
set(SHAMPOO_TORCH_HAS_CUDA OFF)
if(EXISTS "${SHAMPOO_TORCH_LIB_DIR}/libc10_cuda.so")
  set(SHAMPOO_TORCH_HAS_CUDA ON)
endif()

# Gloo headers: the torch wheel ships ProcessGroupGloo.hpp but not the gloo headers it includes.
# Exactly one translation unit (parallel/communication/gloo_backend.cpp) includes it, compiled
# against Debian's libgloo-dev headers, and it must not emit any gloo code: the only gloo that runs
# is the copy inside libtorch_cpu. tests/parallel/gloo_object_check.cmake enforces that.
find_path(SHAMPOO_GLOO_INCLUDE_DIR gloo/rendezvous/store.h)
if(NOT SHAMPOO_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "gloo headers not found: install Debian's libgloo-dev (make deps does)")
endif()

# fmt: the fmt 12 headers that the torch wheel ships in its include folder, header-only
# (FMT_HEADER_ONLY), through the target shampoo_fmt. Not Debian's libfmt-dev (fmt 9): torch's
# include folder comes before /usr/include on every target that uses LibTorch, so `<fmt/...>`
# would be fmt 12 while libfmt.so is fmt 9 (undefined or mismatched symbols); and libtorch does not
# export the compiled part of its fmt (fmt::vformat and friends), so header-only is the one way
# to use torch's headers. Consistently: every target that includes fmt links shampoo_fmt.
find_path(SHAMPOO_FMT_INCLUDE_DIR fmt/base.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT SHAMPOO_FMT_INCLUDE_DIR)
  message(FATAL_ERROR "fmt headers not found in LibTorch's include folders (${TORCH_INCLUDE_DIRS})")
endif()
add_library(shampoo_fmt INTERFACE)
target_include_directories(shampoo_fmt SYSTEM INTERFACE ${SHAMPOO_FMT_INCLUDE_DIR})
target_compile_definitions(shampoo_fmt INTERFACE FMT_HEADER_ONLY)

# Debian packages (scripts/install_deps.sh), header-only except Google Benchmark.
if(SHAMPOO_BUILD_EXAMPLES OR SHAMPOO_BUILD_BENCHMARKS)
  find_package(CLI11 2.1 CONFIG REQUIRED)  # libcli11-dev
endif()
if(SHAMPOO_BUILD_BENCHMARKS)
  find_package(nlohmann_json 3.10 CONFIG REQUIRED)  # nlohmann-json3-dev
  find_package(benchmark 1.7 CONFIG REQUIRED)       # libbenchmark-dev
endif()


if(SHAMPOO_HAS_CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()
