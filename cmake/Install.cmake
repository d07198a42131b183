include(CMakePackageConfigHelpers)
set(_pw_targets pipewright pipewright_headers pipewright_io pipewright_runtime pipewright_kernels_cpu
    pipewright_kernels_cuda pipewright_schedules pipewright_partitioner pipewright_blas
    pipewright_sentencepiece)
if(PIPEWRIGHT_WITH_NCCL)
  list(APPEND _pw_targets pipewright_nccl)
endif()
install(TARGETS ${_pw_targets} EXPORT pipewrightTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS pipewright_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/pipewright DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT pipewrightTargets NAMESPACE pipewright::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pipewright)
configure_package_config_file(cmake/pipewrightConfig.cmake.in
  ${CMAKE_BINARY_DIR}/pipewrightConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pipewright)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/pipewrightConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_BINARY_DIR}/pipewrightConfig.cmake
              ${CMAKE_BINARY_DIR}/pipewrightConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pipewright)
