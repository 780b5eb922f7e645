# Run at build time after a test binary links (see cohort_add_test_binary in
# tests/CMakeLists.txt): lists the binary's GoogleTest cases and writes one
# ctest entry per test suite. Each entry starts the binary once, so the ~1 s
# it takes to load LibTorch is paid per suite, not per case.
# Inputs: BIN (the binary), OUT (the file to write), TIMEOUT (seconds).
execute_process(COMMAND "${BIN}" --gtest_list_tests
                OUTPUT_VARIABLE listing RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "listing the tests of ${BIN} failed (${rc}):\n${listing}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
foreach(line IN LISTS lines)
  # Suite lines start in column 0 and end with a dot, possibly followed by a
  # "# TypeParam = ..." comment; case lines are indented.
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    list(APPEND suites "${CMAKE_MATCH_1}")
  endif()
endforeach()
# A suite whose every case skipped (GTEST_SKIP) is Skipped, not Passed: its
# output ends with GoogleTest's summary of 0 passed and only skipped cases.
# A failure, or anything printed after that list, does not match.
string(CONCAT skipped "\\[  PASSED  \\] 0 tests\\.\n\\[  SKIPPED \\] [0-9]+ tests?, listed below:\n"
       "(\\[  SKIPPED \\] [^\n]*\n?)+$")
set(script "")
foreach(suite IN LISTS suites)
  string(APPEND script
    "add_test([==[${suite}]==] [==[${BIN}]==] [==[--gtest_filter=${suite}.*]==])\n"
    "set_tests_properties([==[${suite}]==] PROPERTIES TIMEOUT ${TIMEOUT}\n"
    "  SKIP_REGULAR_EXPRESSION [==[${skipped}]==])\n")
endforeach()
file(WRITE "${OUT}" "${script}")
