// defines: this_process() and process_state(): this process as words that
// another process can later look up, and what the process they describe is
// doing now; silent_processes(): the words for silent peers from it.
//
// Why: a rank that stops answering may be stopped (SIGSTOP, a debugger),
// hung, or gone (exited, or killed: by the OOM killer, a signal). A peer on
// the same machine can tell which from /proc, and an error that says which
// points the user at the right place, where "stopped, hung, or gone" would
// not. On another machine nothing tells them apart.
#pragma once

#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

/// "MACHINE PID START": the host name with the pid namespace (two
/// containers on one host are two machines), the pid, and the process's
/// start time, which tells it from a later process that reuses its pid.
std::string this_process();

enum class ProcessState {
  Unknown,  // on another machine, or not described: cannot be told
  Running,  // running or sleeping: busy, hung, or waiting elsewhere
  Stopped,  // stopped by a signal (SIGSTOP) or a debugger
  Gone,     // exited or killed: no process, a zombie, or its pid reused
};

/// What the process that `described` (this_process() there) is doing now,
/// seen from this one; `pid`, when given, is set to its pid.
ProcessState process_state(const std::string& described, long* pid = nullptr);

/// What /proc says of the peers `silent` that did not answer within `most`,
/// `described[i]` being this_process() as rank silent[i] gave it (empty when
/// unknown): "; rank 1 did not answer within 1000 ms: its process (pid 4242,
/// on this machine) exited or was killed" for those gone, "; ... is stopped
/// (SIGSTOP, a debugger)" for those stopped. The others (running, or on
/// another machine: nothing tells) are left to the caller's words, in
/// `others`. Each engine's liveness probe words its silent peers here.
std::string silent_processes(const std::vector<int>& silent,
                             const std::vector<std::string>& described, Millis most,
                             std::vector<int>& others);

}  // namespace cohort
