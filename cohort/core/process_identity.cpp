#include "cohort/core/process_identity.h"

#include <unistd.h>

#include <fstream>
#include <sstream>

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

}  // namespace cohort
