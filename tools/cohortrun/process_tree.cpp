#include "process_tree.h"

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace cohortrun {
namespace {

// The parent pid from /proc/<pid>/stat. The command name (field 2) may hold
// spaces and parentheses, so fields are counted from the last ')'.
pid_t parent_of(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string stat;
  std::getline(in, stat);
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  char state = 0;
  int ppid = -1;
  if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) != 2) {
    return -1;
  }
  return ppid;
}

std::vector<pid_t> children() {
  std::vector<pid_t> found;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return found;
  const pid_t self = ::getpid();
  while (dirent* entry = ::readdir(proc)) {
    std::string name = entry->d_name;
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (parent_of(name) == self) found.push_back(std::atoi(name.c_str()));
  }
  ::closedir(proc);
  return found;
}

constexpr int kMaxKillPasses = 1000;

// se.exec_start from a /proc/.../sched file: when the task last started
// running, in ms of its CPU's scheduler clock; 0 if absent.
double exec_start_ms(const std::string& sched_file) {
  std::ifstream in(sched_file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("se.exec_start", 0) != 0) continue;
    const size_t colon = line.find(':');
    return colon == std::string::npos ? 0.0 : std::atof(line.c_str() + colon + 1);
  }
  return 0.0;
}

// The CPU the process last ran on (field 39 of /proc/<pid>/stat), or -1.
int last_cpu(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int k = 3; k <= 39 && fields >> field; ++k) {
    if (k == 39) return std::atoi(field.c_str());
  }
  return -1;
}

double monotonic_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

// How far `cpu`'s scheduler clock runs ahead of CLOCK_MONOTONIC, in ms. The
// clocks of different CPUs disagree (each leaves out its own steal and IRQ
// time; on this project's VM two CPUs were 10 s apart), so exec_start
// values compare only after this correction. Measured by running this
// thread on `cpu` for a moment; NaN if that is not allowed.
double clock_offset_ms(int cpu) {
  cpu_set_t saved;
  if (::sched_getaffinity(0, sizeof saved, &saved) != 0) return std::nan("");
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (::sched_setaffinity(0, sizeof one, &one) != 0) return std::nan("");
  ::sched_yield();
  const double start = exec_start_ms("/proc/thread-self/sched");
  const double now = monotonic_ms();
  ::sched_setaffinity(0, sizeof saved, &saved);
  return start == 0.0 ? std::nan("") : start - now;
}

}  // namespace

void become_subreaper() {
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    throw std::system_error(errno, std::generic_category(), "prctl(PR_SET_CHILD_SUBREAPER)");
  }
}

int kill_stray_children() {
  // Killing a child orphans its own children, which the kernel then hands
  // to us (we are their subreaper): repeat until a pass finds none. The
  // pass count bounds a fork bomb; each pass is one /proc scan.
  int killed = 0;
  for (int pass = 0; pass < kMaxKillPasses; ++pass) {
    std::vector<pid_t> strays = children();
    if (strays.empty()) break;
    for (pid_t pid : strays) ::kill(pid, SIGKILL);
    for (pid_t pid : strays) {
      while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
    killed += static_cast<int>(strays.size());
  }
  return killed;
}

double last_ran_ms(pid_t pid) {
  const double start = exec_start_ms("/proc/" + std::to_string(pid) + "/sched");
  const int cpu = last_cpu(pid);
  if (start == 0.0 || cpu < 0) return start;
  const double offset = clock_offset_ms(cpu);
  return std::isnan(offset) ? start : start - offset;
}

}  // namespace cohortrun
