# Script mode: install, build the consumer against the install tree, run it.
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(required include/shampoo/shampoo.h include/shampoo/config.h
                 include/distributor/process_group.h
                 lib/cmake/DistributedShampoo/DistributedShampooConfig.cmake)
  if(NOT EXISTS "${prefix}/${required}")
    message(FATAL_ERROR "install tree lacks ${required}")
  endif()
endforeach()
# The consumer finds the package from the prefix alone (Torch through the package's hint).
run_step("configure consumer" ${CMAKE_COMMAND} -S "${CONSUMER_DIR}" -B "${WORK_DIR}/consumer"
         -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run_step("build consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/consumer")
run_step("run consumer" "${WORK_DIR}/consumer/consumer")
message(STATUS "consumer said: ${step_output}")
if(NOT step_output MATCHES "consumer: ok")
  message(FATAL_ERROR "consumer did not report success: ${step_output}")
endif()
