# The check behind cohort_bench_flags (bench/CMakeLists.txt), run as
#   cmake -D BIN=... -D "FLAGS=--a=1;--b" -P check_flags.cmake
# BIN --help must exit 0 and list each FLAGS entry: NAME=DEFAULT as CLI11
# prints it ("--steps INT:POSITIVE=20" in CLI11 2.3, "--steps INT:POSITIVE
# [20]" in 2.4), or a bare NAME; BIN --no-such-flag
# must exit non-zero with CLI11's pointer to --help.
execute_process(COMMAND ${BIN} --help OUTPUT_VARIABLE help ERROR_VARIABLE err
                RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BIN} --help exited with ${rc}:\n${help}${err}")
endif()
foreach(flag IN LISTS FLAGS)
  if(flag MATCHES "^([^=]+)=(.*)$")
    set(name "${CMAKE_MATCH_1}")
    string(REGEX REPLACE "([.+*?^$()])" "\\\\\\1" value "${CMAKE_MATCH_2}")
    set(pattern "(^|[ \n])${name} [^ \n]*(=${value}| \\[${value}\\])[ \n]")
  else()
    set(name "${flag}")
    set(pattern "(^|[ \n])${name}[ \n]")
  endif()
  if(NOT help MATCHES "${pattern}")
    message(FATAL_ERROR "${BIN} --help does not list ${flag}:\n${help}")
  endif()
endforeach()
execute_process(COMMAND ${BIN} --no-such-flag OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc TIMEOUT 60)
if(rc EQUAL 0 OR NOT err MATCHES "Run with --help")
  message(FATAL_ERROR "${BIN} --no-such-flag exited with ${rc}, not CLI11's error:\n${out}${err}")
endif()
