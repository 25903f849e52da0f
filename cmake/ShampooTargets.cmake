# Helpers shared by every target of the project: warnings, sanitizers, precompiled headers.

set(SHAMPOO_WARNINGS -Wall -Wextra -Wno-unused-parameter)
# Position-independent code (-fPIC) for every target, libraries and executables alike: the
# libraries are linked into the Python extension module (a shared object), and one flag for all
# keeps the shared precompiled header valid everywhere (GCC refuses a header built with other
# -fpic/-fpie settings).
set(SHAMPOO_PIC $<$<COMPILE_LANGUAGE:CXX>:-fPIC> $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fPIC>)

# One precompiled header for the whole project, built once and reused by every target that has
# the same compile flags (all of ours).
add_library(shampoo_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp)
target_link_libraries(shampoo_pch PUBLIC torch)
target_compile_features(shampoo_pch PUBLIC cxx_std_20)
target_compile_options(shampoo_pch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${SHAMPOO_WARNINGS}> ${SHAMPOO_PIC})
if(SHAMPOO_SANITIZE)
  # The precompiled header must be built with the same sanitizer flags as its users.
  target_compile_options(shampoo_pch PRIVATE -fsanitize=${SHAMPOO_SANITIZE} -fno-omit-frame-pointer)
endif()
if(SHAMPOO_USE_PCH)
  target_precompile_headers(shampoo_pch PRIVATE ${PROJECT_SOURCE_DIR}/cmake/shampoo_pch.h)
endif()

function(shampoo_apply_common target)
  target_compile_features(${target} PUBLIC cxx_std_20)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${SHAMPOO_WARNINGS}> ${SHAMPOO_PIC})
  if(SHAMPOO_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${SHAMPOO_SANITIZE} -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=${SHAMPOO_SANITIZE})
  endif()
  if(SHAMPOO_USE_PCH AND NOT target STREQUAL "shampoo_pch")
    target_precompile_headers(${target} REUSE_FROM shampoo_pch)
  endif()
endfunction()

# shampoo_add_component(<name> SOURCES ... [CUDA_SOURCES ...] [DEPS ...])
# One component folder = one library `shampoo_<name>`, alias `shampoo::<name>`, exported as
# `DistributedShampoo::<name>`.
function(shampoo_add_component name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target shampoo_${name})
  set(sources ${ARG_SOURCES})
  if(SHAMPOO_HAS_CUDA)
    list(APPEND sources ${ARG_CUDA_SOURCES})
  endif()
  add_library(${target} STATIC ${sources})
  add_library(shampoo::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME shampoo_${name})
  # Installed: <shampoo/shampoo.h> from include/, and the public headers' own includes
  # ("parallel/...", "amp/...") from include/shampoo/ (cmake/ShampooInstall.cmake).
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/shampoo>)
  target_link_libraries(${target} PUBLIC torch ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  target_compile_features(${target} PUBLIC cxx_std_20)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>)
  shampoo_apply_common(${target})
  set_property(GLOBAL APPEND PROPERTY SHAMPOO_COMPONENTS ${target})
endfunction()
