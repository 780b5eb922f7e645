#include "cohort/core/process_identity.h"

#include <unistd.h>

#include <fstream>
#include <sstream>

#include "cohort/core/signature.h"

namespace cohort {
namespace {

std::string machine() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  char ns[64] = {};
  const auto n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  return std::string(host) + (n > 0 ? "/" + std::string(ns, static_cast<size_t>(n)) : "");
}

// The state letter and start time (fields 3 and 22 of /proc/PID/stat, in
// clock ticks since boot); false when there is no such process to read.
bool read_stat(long pid, char* state, unsigned long long* start) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  // The command name, field 2, is in parentheses and may hold both spaces
  // and parentheses: the fields after it start after the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string skipped;
  rest >> *state;
  for (int field = 4; field < 22; ++field) rest >> skipped;
  rest >> *start;
  return static_cast<bool>(rest);
}

// "rank 1 did not answer within 1500 ms: its process (pid 4242, on this
// machine) <state>" (`state` for one process, `states` for several).
std::string on_this_machine(const std::vector<int>& ranks, const std::vector<long>& pids,
                            Millis most, const char* state, const char* states) {
  std::string listed;
  for (long p : pids) listed += (listed.empty() ? "" : ", ") + std::to_string(p);
  const bool one = ranks.size() == 1;
  return name_ranks(ranks) + " did not answer within " + std::to_string(most.count()) +
         " ms: " + (one ? "its process (pid " : "their processes (pids ") + listed +
         ", on this machine) " + (one ? state : states);
}

}  // namespace

std::string this_process() {
  const long pid = static_cast<long>(::getpid());
  char state = 0;
  unsigned long long start = 0;  // 0: unreadable, and then never compared
  read_stat(pid, &state, &start);
  return machine() + " " + std::to_string(pid) + " " + std::to_string(start);
}

ProcessState process_state(const std::string& described, long* pid) {
  std::istringstream in(described);
  std::string where;
  long p = 0;
  unsigned long long start = 0;
  if (!(in >> where >> p >> start) || p <= 0 || start == 0 || where != machine()) {
    return ProcessState::Unknown;
  }
  if (pid) *pid = p;
  char state = 0;
  unsigned long long now = 0;
  if (!read_stat(p, &state, &now) || now != start) return ProcessState::Gone;
  // Z: a zombie, dead and not yet reaped by its parent (the launcher);
  // X: dead. T: stopped by a signal; t: stopped by a debugger (ptrace).
  if (state == 'Z' || state == 'X') return ProcessState::Gone;
  if (state == 'T' || state == 't') return ProcessState::Stopped;
  return ProcessState::Running;
}

std::string silent_processes(const std::vector<int>& silent,
                             const std::vector<std::string>& described, Millis most,
                             std::vector<int>& others) {
  std::vector<int> gone, stopped;
  std::vector<long> gone_pids, stopped_pids;
  for (size_t i = 0; i < silent.size(); ++i) {
    long pid = 0;
    switch (process_state(i < described.size() ? described[i] : "", &pid)) {
      case ProcessState::Gone:
        gone.push_back(silent[i]);
        gone_pids.push_back(pid);
        break;
      case ProcessState::Stopped:
        stopped.push_back(silent[i]);
        stopped_pids.push_back(pid);
        break;
      default:
        others.push_back(silent[i]);
    }
  }
  std::string text;
  if (!gone.empty()) {
    text += "; " +
            on_this_machine(gone, gone_pids, most, "exited or was killed", "exited or were killed");
  }
  if (!stopped.empty()) {
    text += "; " + on_this_machine(stopped, stopped_pids, most, "is stopped (SIGSTOP, a debugger)",
                                   "are stopped (SIGSTOP, a debugger)");
  }
  return text;
}

}  // namespace cohort
