# Script mode: install into a scratch prefix, then configure, build and run a project outside
# this repository against the install tree, as a C++17 and as a C++20 project (C++20 used to fail
# inside find_package on a machine with nvcc), each time with README.md's marked C++ blocks
# compiled as written (readme_snippets.cmake) and run; and as a C++20 project that finds Torch
# first, with the line README.md documents for it.
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/readme_snippets.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(run_step what)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY "${WORK_DIR}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(required include/shampoo/shampoo.h include/shampoo/config.h
                 include/shampoo/parallel/communication/process_group.h
                 lib/cmake/DistributedShampoo/DistributedShampooConfig.cmake)
  if(NOT EXISTS "${prefix}/${required}")
    message(FATAL_ERROR "install tree lacks ${required}")
  endif()
endforeach()
# Only the public headers: everything under include/ is shampoo/shampoo.h or reached from it by
# its includes, and nothing is outside include/shampoo/.
file(GLOB_RECURSE installed RELATIVE "${prefix}/include" "${prefix}/include/*")
set(reached shampoo/shampoo.h)
set(pending shampoo/shampoo.h)
while(pending)
  list(POP_FRONT pending header)
  get_filename_component(folder "${header}" DIRECTORY)
  file(STRINGS "${prefix}/include/${header}" lines REGEX "^#include \"")
  foreach(line ${lines})
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" included "${line}")
    # As the compiler finds it: beside the includer, then include/, then include/shampoo/.
    set(found "")
    foreach(candidate "${folder}/${included}" "${included}" "shampoo/${included}")
      if(NOT found AND EXISTS "${prefix}/include/${candidate}")
        set(found "${candidate}")
      endif()
    endforeach()
    if(NOT found)
      message(FATAL_ERROR "install tree: ${header} includes ${included}, which is not installed")
    endif()
    if(NOT found IN_LIST reached)
      list(APPEND reached "${found}")
      list(APPEND pending "${found}")
    endif()
  endforeach()
endwhile()
foreach(file ${installed})
  if(NOT file IN_LIST reached)
    message(FATAL_ERROR "install tree: include/${file} is installed but not public (not reached "
                        "from shampoo/shampoo.h)")
  endif()
endforeach()
# The wrappers' internal interfaces live behind the public classes (parallel/optimizers/
# capabilities.h): installing one again would make it part of the public surface.
foreach(internal parallel/optimizers/parameter_owners.h parallel/optimizers/block_states.h
        parallel/optimizers/phased_step.h parallel/optimizers/capabilities.h
        parallel/optimizers/internal_interfaces.h parallel/optimizers/local_optimizer.h
        parallel/communication/ownership_plan.h)
  if(EXISTS "${prefix}/include/shampoo/${internal}")
    message(FATAL_ERROR "install tree: the internal header ${internal} is installed")
  endif()
endforeach()
list(LENGTH installed installed_count)
message(STATUS "install tree: ${installed_count} public headers")

set(snippets_source "${WORK_DIR}/readme_snippets.cpp")
shampoo_write_readme_snippets("${README}" "${snippets_source}" snippets)
message(STATUS "README.md blocks compiled: ${snippets}")
if(NOT "quickstart" IN_LIST snippets)
  message(FATAL_ERROR "README.md: its first C++ block is not marked `<!-- compile: quickstart -->`")
endif()

set(launcher "")
find_program(ccache_program ccache)
if(ccache_program)
  set(launcher "-DCMAKE_CXX_COMPILER_LAUNCHER=${ccache_program}")
endif()
foreach(standard 17 20)
  set(consumer "${WORK_DIR}/consumer_cxx${standard}")
  # The consumer finds the package from the prefix alone (Torch through the package's hint).
  run_step("configure consumer (C++${standard})"
           ${CMAKE_COMMAND} -S "${CONSUMER_DIR}" -B "${consumer}" -DCMAKE_PREFIX_PATH=${prefix}
           -DCMAKE_BUILD_TYPE=Release -DCONSUMER_CXX_STANDARD=${standard}
           -DREADME_SNIPPETS=${snippets_source} ${launcher})
  # The quadratic-minimizing consumer once; the README's blocks for every standard.
  set(targets readme_snippets)
  if(standard EQUAL 17)
    list(APPEND targets consumer)
  endif()
  run_step("build consumer (C++${standard})"
           ${CMAKE_COMMAND} --build "${consumer}" --target ${targets})
  run_step("run README snippets (C++${standard})" "${consumer}/readme_snippets")
  message(STATUS "C++${standard}: ${step_output}")
  if(NOT step_output MATCHES "readme snippets: ok")
    message(FATAL_ERROR "the README snippets did not report success: ${step_output}")
  endif()
endforeach()

# A C++20 project that finds Torch before the package, with the line README.md documents.
set(torch_first "${WORK_DIR}/consumer_cxx20_torch_first")
run_step("configure consumer (C++20, find_package(Torch) first)"
         ${CMAKE_COMMAND} -S "${CONSUMER_DIR}" -B "${torch_first}" -DCMAKE_PREFIX_PATH=${prefix}
         -DCMAKE_BUILD_TYPE=Release -DCONSUMER_CXX_STANDARD=20 -DCONSUMER_TORCH_FIRST=ON
         -DTorch_DIR=${TORCH_DIR} ${launcher})
run_step("build consumer (C++20, find_package(Torch) first)"
         ${CMAKE_COMMAND} --build "${torch_first}" --target consumer)
run_step("run consumer (C++20, find_package(Torch) first)" "${torch_first}/consumer")
if(NOT step_output MATCHES "consumer: ok")
  message(FATAL_ERROR "the Torch-first consumer did not report success: ${step_output}")
endif()

run_step("run consumer" "${WORK_DIR}/consumer_cxx17/consumer")
message(STATUS "consumer said: ${step_output}")
if(NOT step_output MATCHES "consumer: ok")
  message(FATAL_ERROR "consumer did not report success: ${step_output}")
endif()
