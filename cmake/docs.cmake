# The API reference: Doxygen over the installed public headers (the list in
# cohort/CMakeLists.txt). Any warning fails it, undocumented public API
# included, so the reference stays complete; ctest runs it as `docs`.
# scripts/install-deps.sh installs doxygen, so without it the test fails
# (saying so) rather than passing unchecked.
find_program(DOXYGEN_EXECUTABLE doxygen)
if(NOT DOXYGEN_EXECUTABLE)
  message(WARNING "cohort: doxygen not found (scripts/install-deps.sh installs it); no docs target")
  if(COHORT_BUILD_TESTS)
    add_test(NAME docs COMMAND ${CMAKE_COMMAND} -E echo
                               "doxygen not found: run scripts/install-deps.sh")
    set_tests_properties(docs PROPERTIES FAIL_REGULAR_EXPRESSION "not found" TIMEOUT 10)
  endif()
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
if(COHORT_BUILD_TESTS)
  add_test(NAME docs COMMAND ${DOXYGEN_EXECUTABLE} ${PROJECT_BINARY_DIR}/Doxyfile)
  set_tests_properties(docs PROPERTIES TIMEOUT 120)
  # Its negative control: the same configuration over a planted public
  # header whose type has no doc comment must fail, naming the type.
  # (Doxygen passes over an undocumented type with no members at all.)
  set(planted_dir ${PROJECT_BINARY_DIR}/docs_planted)
  file(WRITE ${planted_dir}/cohort/planted.h
       "#pragma once\nnamespace cohort {\nstruct PlantedUndocumented {\n  /// A member.\n  int x = 0;\n};\n}\n")
  set(COHORT_DOXYGEN_INPUT "\"${planted_dir}/cohort/planted.h\"")
  set(COHORT_DOXYGEN_OUTPUT ${planted_dir}/out)
  configure_file(${PROJECT_SOURCE_DIR}/docs/Doxyfile.in ${planted_dir}/Doxyfile @ONLY)
  add_test(NAME docs_fails_on_undocumented
           COMMAND sh -c "! '${DOXYGEN_EXECUTABLE}' '${planted_dir}/Doxyfile' > '${planted_dir}/log' 2>&1 && grep 'PlantedUndocumented.*not documented' '${planted_dir}/log'")
  set_tests_properties(docs_fails_on_undocumented PROPERTIES TIMEOUT 60)
endif()
