# Script mode. OBJECT: the objects of shampoo_parallel_communication (;-list). Fails if
# gloo_backend's object references or defines any symbol of namespace gloo (mangled _ZN4gloo /
# N4gloo).
set(found "")
foreach(object ${OBJECT})
  if(object MATCHES "gloo_backend")
    set(found "${object}")
  endif()
endforeach()
if(NOT found)
  message(FATAL_ERROR "gloo_backend object not found among: ${OBJECT}")
endif()
execute_process(COMMAND ${NM} "${found}" OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nm failed on ${found}")
endif()
string(REGEX MATCHALL "[^\n]*N4gloo[^\n]*" gloo_symbols "${symbols}")
if(gloo_symbols)
  message(FATAL_ERROR "gloo_backend.o uses gloo symbols, so the gloo headers it was compiled with "
                      "matter: ${gloo_symbols}")
endif()
string(REGEX MATCHALL "[^\n]*ProcessGroupGloo[^\n]*" pg_symbols "${symbols}")
message(STATUS "gloo_backend.o: no gloo symbols; ProcessGroupGloo symbols used:\n${pg_symbols}")
