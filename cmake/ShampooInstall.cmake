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
# The public headers only: shampoo/shampoo.h and what it includes (checked by
# tests/install/install_test.cmake). shampoo/<name>.h goes to include/shampoo/<name>.h, the other
# folders' headers under include/shampoo/<folder>/, so nothing generic ("parallel/", ...) lands at
# the top of the include tree. The internals (engine, lists, kernels, distributor) are not
# installed.
set(SHAMPOO_PUBLIC_HEADERS
  amp/autocast_guard.h
  amp/grad_scaler.h
  parallel/clip_grad_norm.h
  parallel/checkpoints/distributed_checkpoint.h
  parallel/full_sharding/fully_sharded.h
  parallel/data_parallel/gradient_synchronizer.h
  parallel/in_backward/in_backward.h
  parallel/optimizers/loss_scaling.h
  parallel/optimizers/optimizer_factory.h
  parallel/optimizers/portable_checkpoint.h
  parallel/communication/process_group.h
  parallel/state_sharding/sharded_optimizer.h
  preconditioners/memory_summary.h
  preconditioners/preconditioner_configs.h
  shampoo/checkpoint.h
  shampoo/distributed_shampoo.h
  shampoo/fault_point.h
  shampoo/lr_schedulers.h
  shampoo/shampoo.h
  shampoo/shampoo_options.h
  shampoo/training_checkpoint.h
  shampoo/wrapped_shampoo.h)
foreach(header ${SHAMPOO_PUBLIC_HEADERS})
  get_filename_component(folder ${header} DIRECTORY)
  set(destination ${CMAKE_INSTALL_INCLUDEDIR}/shampoo)
  if(NOT folder STREQUAL "shampoo")
    set(destination ${destination}/${folder})
  endif()
  install(FILES ${PROJECT_SOURCE_DIR}/${header} DESTINATION ${destination})
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
