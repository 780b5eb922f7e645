// defines: RankProcess, spawn_rank — starting one rank with its output
// captured.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "fd.h"

namespace cohortrun {

// A started rank. Its pid is also its process group id: signalling -pid
// reaches every process the rank started that stayed in its group.
struct RankProcess {
  pid_t pid = -1;
  UniqueFd out;  // read end of the rank's stdout, non-blocking
  UniqueFd err;  // read end of the rank's stderr, non-blocking
};

// Forks and execs `command` (looked up in PATH) with `env`, stdin from
// /dev/null, in a new process group, and set to be SIGKILLed if the launcher
// dies. A program that cannot be executed makes the rank print why on its
// stderr and exit 127 (not found) or 126 (not executable), as a shell would.
// Throws std::system_error when the launcher cannot create pipes or fork.
// `inherit_fd` (when >= 0) stays open across exec in the rank, at its number.
RankProcess spawn_rank(const std::vector<std::string>& command, const std::vector<std::string>& env,
                       int inherit_fd = -1);

}  // namespace cohortrun
