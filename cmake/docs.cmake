# The API reference: Doxygen over the installed public headers (the list in
# cohort/CMakeLists.txt). Any warning fails it, undocumented public API
# included. It is not in the test command while headers merged from the
# compression, statistics and hardening work still carry plain `//`
# comments (doxygen lists them); build it with `cmake --build build --target docs`.
find_program(DOXYGEN_EXECUTABLE doxygen)
if(NOT DOXYGEN_EXECUTABLE)
  message(STATUS "cohort: doxygen not found; no docs target")
  return()
endif()
get_property(COHORT_DOXYGEN_HEADERS GLOBAL PROPERTY COHORT_PUBLIC_HEADERS)
list(JOIN COHORT_DOXYGEN_HEADERS "\" \\\n  \"" COHORT_DOXYGEN_INPUT)
set(COHORT_DOXYGEN_INPUT "\"${COHORT_DOXYGEN_INPUT}\"")
set(COHORT_DOXYGEN_OUTPUT ${PROJECT_BINARY_DIR}/docs)
configure_file(${PROJECT_SOURCE_DIR}/docs/Doxyfile.in ${PROJECT_BINARY_DIR}/Doxyfile @ONLY)
add_custom_target(docs
  COMMAND ${DOXYGEN_EXECUTABLE} ${PROJECT_BINARY_DIR}/Doxyfile
  COMMENT "Doxygen: API reference in ${COHORT_DOXYGEN_OUTPUT}/html"
  VERBATIM)
