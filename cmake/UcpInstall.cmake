# install() and export so a trainer's CMake project can find_package(ucp) and link ucp::ucp.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(ucp_targets GLOBAL PROPERTY UCP_INSTALL_TARGETS)
install(TARGETS ${ucp_targets} ucp_third_party_hdf5 EXPORT ucpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/libucp/ucp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h" PATTERN "*.inc" PATTERN "*_test*" EXCLUDE)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/patterns ${PROJECT_SOURCE_DIR}/schemas
        DESTINATION ${CMAKE_INSTALL_DATADIR}/ucp)
install(EXPORT ucpTargets NAMESPACE ucp:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ucp)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ucpConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/ucpConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ucp)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/ucpConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ucpConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/ucpConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ucp)
