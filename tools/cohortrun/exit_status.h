// defines: ExitStatus (how a rank ended, from waitpid) and signal_name.
#pragma once

#include <string>

namespace cohortrun {

// Exit code for a job that ran past --timeout, as timeout(1) uses.
constexpr int kTimeoutExitCode = 124;

class ExitStatus {
 public:
  ExitStatus() = default;
  explicit ExitStatus(int wait_status) : wait_status_(wait_status) {}

  bool failed() const;
  // The launcher's own exit code for this ending: the rank's code, or
  // 128 + signal as a shell reports a killed command.
  int exit_code() const;
  // "exited with code 3" or "killed by signal 9 (SIGKILL)".
  std::string describe() const;

 private:
  int wait_status_ = 0;
};

// "SIGKILL" for 9; "signal 64" style text for numbers without a name.
std::string signal_name(int sig);

}  // namespace cohortrun
