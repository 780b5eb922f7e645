# `cmake --install`: libcohort, its public headers, cohortrun, cohort-plot,
# cohort-bench, and the CMake package (cohortConfig.cmake, its version file,
# the exported cohort::cohort target).
include(CMakePackageConfigHelpers)

set(COHORT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/cohort)

install(TARGETS cohort EXPORT cohortTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT cohortTargets NAMESPACE cohort:: DESTINATION ${COHORT_INSTALL_CMAKEDIR})

# The config finds what the exported target needs: Torch, Threads,
# nlohmann_json (an installed header uses it), MPI when this build has its
# engine (linked publicly) and, for a static libcohort only, zlib and UCX,
# which a consumer's link then needs too.
if(COHORT_BUILD_SHARED)
  set(COHORT_PACKAGE_STATIC OFF)
else()
  set(COHORT_PACKAGE_STATIC ON)
endif()
if(TARGET MPI::MPI_C)
  set(COHORT_PACKAGE_WITH_MPI ON)
else()
  set(COHORT_PACKAGE_WITH_MPI OFF)
endif()
if(TARGET PkgConfig::UCX AND COHORT_PACKAGE_STATIC)
  set(COHORT_PACKAGE_WITH_UCX ON)
else()
  set(COHORT_PACKAGE_WITH_UCX OFF)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cohortConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cohortConfig.cmake
  INSTALL_DESTINATION ${COHORT_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API, so only the same minor matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cohortConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cohortConfig.cmake
              ${PROJECT_BINARY_DIR}/cohortConfigVersion.cmake
        DESTINATION ${COHORT_INSTALL_CMAKEDIR})
