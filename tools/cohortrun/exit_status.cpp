#include "exit_status.h"

#include <sys/wait.h>

#include <cstring>

namespace cohortrun {

bool ExitStatus::failed() const { return exit_code() != 0; }

int ExitStatus::exit_code() const {
  if (WIFEXITED(wait_status_)) return WEXITSTATUS(wait_status_);
  if (WIFSIGNALED(wait_status_)) return 128 + WTERMSIG(wait_status_);
  return 1;
}

std::string ExitStatus::describe() const {
  if (WIFEXITED(wait_status_)) {
    return "exited with code " + std::to_string(WEXITSTATUS(wait_status_));
  }
  if (WIFSIGNALED(wait_status_)) {
    int sig = WTERMSIG(wait_status_);
    return "killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
  }
  return "ended with wait status " + std::to_string(wait_status_);
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev == nullptr) return "signal " + std::to_string(sig);
  return std::string("SIG") + abbrev;
}

}  // namespace cohortrun
