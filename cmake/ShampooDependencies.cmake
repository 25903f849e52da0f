# LibTorch (from the torch wheel, see scripts/install_deps.sh), fmt, and CUDA libraries.

# TorchConfig probes the CUDA toolkit itself; keep its messages but not its warnings about
# CMAKE_CUDA_ARCHITECTURES (we set those for our own kernels).
# TORCH_CUDA_ARCH_LIST set: no GPU probing (there may be no GPU on the build machine).
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
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
# Exactly one translation unit (parallel/gloo_backend.cpp) includes it, compiled against
# Debian's libgloo-dev headers, and it must not emit any gloo code: the only gloo that runs is the
# copy inside libtorch_cpu. tests/parallel/gloo_object_check.cmake enforces that.
find_path(SHAMPOO_GLOO_INCLUDE_DIR gloo/rendezvous/store.h)
if(NOT SHAMPOO_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "gloo headers not found: install Debian's libgloo-dev (make deps does)")
endif()

# fmt: the torch wheel bundles its own fmt headers, which would shadow Debian's; we format with
# c10::str and std::ostringstream instead of linking libfmt.


if(SHAMPOO_HAS_CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()
