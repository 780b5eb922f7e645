// defines: SignalFd — SIGCHLD, SIGINT, SIGTERM and SIGHUP delivered through
// a file descriptor.
#pragma once

#include <vector>

#include "fd.h"

namespace cohortrun {

// The signals are blocked and read from a signalfd, so the event loop sees
// them and pipe data in a single poll(), with no handler and no race between
// checking a flag and going to sleep. Blocked signals stay pending between
// attempts; none is lost. Spawned ranks unblock them before exec.
// SIGHUP is left alone when it was ignored at startup (nohup).
class SignalFd {
 public:
  SignalFd();

  int fd() const { return fd_.get(); }
  // The signals that arrived since the last call; never blocks. Several
  // SIGCHLDs may arrive as one: callers reap until waitpid finds no more.
  std::vector<int> take();

 private:
  UniqueFd fd_;
};

// Whether `sig` asks the launcher to stop (SIGINT, SIGTERM, SIGHUP).
bool is_interrupt(int sig);

}  // namespace cohortrun
