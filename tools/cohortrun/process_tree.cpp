#include "process_tree.h"

#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
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
  std::ifstream in("/proc/" + std::to_string(pid) + "/sched");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("se.exec_start", 0) != 0) continue;
    const size_t colon = line.find(':');
    return colon == std::string::npos ? 0.0 : std::atof(line.c_str() + colon + 1);
  }
  return 0.0;
}

}  // namespace cohortrun
