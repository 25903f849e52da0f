# make install PREFIX=...: headers, static libraries, and the CMake package DistributedShampoo
# (find_package(DistributedShampoo) -> DistributedShampoo::shampoo).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(shampoo_components GLOBAL PROPERTY SHAMPOO_COMPONENTS)
install(TARGETS ${shampoo_components}
  EXPORT DistributedShampooTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(component shampoo amp distributor parallel preconditioners update)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${component}/
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${component}
    FILES_MATCHING PATTERN "*.h" PATTERN "cuda/*.cu" EXCLUDE)
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/include/shampoo/config.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shampoo)
install(EXPORT DistributedShampooTargets
  NAMESPACE DistributedShampoo::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/DistributedShampoo)

set(SHAMPOO_INSTALL_TORCH_DIR "${Torch_DIR}")
# The CUDA architectures LibTorch was configured with here (cmake/ShampooDependencies.cmake):
# the package config hands them to TorchConfig so that it does not probe the consumer's GPU.
if(DEFINED TORCH_CUDA_ARCH_LIST)
  set(SHAMPOO_INSTALL_TORCH_CUDA_ARCH_LIST "${TORCH_CUDA_ARCH_LIST}")
else()
  set(SHAMPOO_INSTALL_TORCH_CUDA_ARCH_LIST "$ENV{TORCH_CUDA_ARCH_LIST}")
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/DistributedShampooConfig.cmake.in
  ${PROJECT_BINARY_DIR}/DistributedShampooConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/DistributedShampoo)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/DistributedShampooConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/DistributedShampooConfig.cmake
  ${PROJECT_BINARY_DIR}/DistributedShampooConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/DistributedShampoo)
