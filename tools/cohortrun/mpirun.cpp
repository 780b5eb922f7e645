#include "mpirun.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <system_error>

#include "exit_status.h"
#include "mpirun_output.h"
#include "output.h"
#include "signal_fd.h"
#include "spawn.h"

extern char** environ;

namespace cohortrun {
namespace {

// Open MPI's major version from `mpirun --version` ("mpirun (Open MPI)
// 5.0.7"); 0 when it says something else.
int open_mpi_major() {
  FILE* pipe = ::popen("mpirun --version 2>/dev/null", "r");
  if (pipe == nullptr) return 0;
  std::string text;
  char buf[256];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) text.append(buf, n);
  ::pclose(pipe);
  const std::string marker = "(Open MPI) ";
  const size_t at = text.find(marker);
  return at == std::string::npos ? 0 : std::atoi(text.c_str() + at + marker.size());
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "/usr/bin:/bin";
  while (true) {
    const size_t colon = dirs.find(':');
    std::string dir(dirs.substr(0, colon));
    if (dir.empty()) dir = ".";
    if (::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    if (colon == std::string_view::npos) return false;
    dirs.remove_prefix(colon + 1);
  }
}

// Reads what `fd` holds into `output`; at end of stream flushes it and
// closes fd.
void drain(UniqueFd& fd, MpirunOutput& output) {
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n > 0) {
      output.feed(std::string_view(buf, static_cast<size_t>(n)));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {
      output.flush();
      fd.reset();
      return;
    }
  }
}

}  // namespace

std::vector<std::string> mpirun_command(const Options& options, bool as_root, long online_cores) {
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(options.nproc_per_node)};
  if (as_root) cmd.push_back("--allow-run-as-root");
  if (options.nproc_per_node > online_cores) cmd.push_back("--oversubscribe");
  // One node: keep mpirun's control channel and the ranks' TCP transport on
  // loopback (by default both listen on every interface).
  // (The control channel's setting goes through the environment, run_mpirun:
  // Open MPI 5's mpirun refuses it as a flag, "No network interfaces were
  // found for out-of-band communications", and 4.1 reads either.)
  cmd.insert(cmd.end(), {"--mca", "btl_tcp_if_include", "lo"});
  // Tags name each line's rank; run_mpirun turns them into "[rank] ".
  cmd.push_back("--tag-output");
  cmd.insert(cmd.end(), {"-x", "COHORT_BACKEND=mpi"});
  // Open MPI gives the ranks a pseudo-terminal, but the lines are cut at
  // '\n': the Trainer's progress comes as log lines, as under Gloo.
  cmd.insert(cmd.end(), {"-x", "COHORT_PROGRESS=lines"});
  // --trace: the value main() put in our environment (an absolute path).
  if (!options.trace_dir.empty()) cmd.insert(cmd.end(), {"-x", "COHORT_TRACE"});
  cmd.insert(cmd.end(), options.command.begin(), options.command.end());
  return cmd;
}

int run_mpirun(const Options& options) {
  if (!on_path("mpirun")) {
    log_line("cannot exec mpirun: not found on PATH (is an MPI implementation installed?)");
    return 127;
  }
  SignalFd signals;  // before the fork: no signal is missed
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  env.emplace_back("OMPI_MCA_oob_tcp_if_include=lo");
  RankProcess mpirun =
      spawn_rank(mpirun_command(options, ::geteuid() == 0, ::sysconf(_SC_NPROCESSORS_ONLN)), env);
  const bool space_after_tag = open_mpi_major() >= 5;
  MpirunOutput out(STDOUT_FILENO, space_after_tag), err(STDERR_FILENO, space_after_tag);
  std::optional<ExitStatus> status;
  // Until mpirun has exited and its pipes are closed (a rank that outlives
  // it and keeps them open must not hold the launcher: stop then).
  while (!status || (mpirun.out.valid() || mpirun.err.valid())) {
    std::vector<pollfd> fds{{signals.fd(), POLLIN, 0}};
    if (mpirun.out.valid()) fds.push_back({mpirun.out.get(), POLLIN, 0});
    if (mpirun.err.valid()) fds.push_back({mpirun.err.get(), POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), status ? 1000 : -1);
    if (n < 0 && errno != EINTR) throw std::system_error(errno, std::generic_category(), "poll");
    if (n == 0) break;  // mpirun exited a second ago and its pipes are still open
    if (mpirun.out.valid()) drain(mpirun.out, out);
    if (mpirun.err.valid()) drain(mpirun.err, err);
    for (int sig : signals.take()) {
      // mpirun stops its ranks on SIGINT and SIGTERM (a second SIGINT at once).
      if (is_interrupt(sig) && !status) ::kill(mpirun.pid, sig);
    }
    int wait_status = 0;
    if (!status && ::waitpid(mpirun.pid, &wait_status, WNOHANG) == mpirun.pid) {
      status = ExitStatus(wait_status);
    }
  }
  if (mpirun.out.valid()) out.flush();
  if (mpirun.err.valid()) err.flush();
  return status->exit_code();
}

}  // namespace cohortrun
