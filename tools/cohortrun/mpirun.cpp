#include "mpirun.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "output.h"

namespace cohortrun {

std::vector<std::string> mpirun_command(const Options& options, bool as_root, long online_cores) {
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(options.nproc_per_node)};
  if (as_root) cmd.push_back("--allow-run-as-root");
  if (options.nproc_per_node > online_cores) cmd.push_back("--oversubscribe");
  // One node: keep mpirun's control channel and the ranks' TCP transport on
  // loopback (by default both listen on every interface).
  cmd.insert(cmd.end(), {"--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"});
  cmd.insert(cmd.end(), {"-x", "COHORT_BACKEND=mpi"});
  // --trace: the value main() put in our environment (an absolute path).
  if (!options.trace_dir.empty()) cmd.insert(cmd.end(), {"-x", "COHORT_TRACE"});
  cmd.insert(cmd.end(), options.command.begin(), options.command.end());
  return cmd;
}

int exec_mpirun(const Options& options) {
  std::vector<std::string> cmd =
      mpirun_command(options, ::geteuid() == 0, ::sysconf(_SC_NPROCESSORS_ONLN));
  std::vector<char*> argv;
  for (std::string& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  log_line(std::string("cannot exec mpirun: ") + std::strerror(errno) +
           " (is an MPI implementation installed and on PATH?)");
  return 127;
}

}  // namespace cohortrun
