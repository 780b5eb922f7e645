// defines: Options (the parsed command line), UsageError, parse_options.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace cohortrun {

struct Options {
  int nproc_per_node = 0;            // ranks this launcher starts (-n, or MAX of -n MIN:MAX)
  int min_nproc = 0;                 // elastic: fewest ranks to go on with (MIN of -n MIN:MAX)
  int nnodes = 1;                    // nodes in the job, each running cohortrun
  int node_rank = 0;                 // this node's index in [0, nnodes)
  std::string master_addr;           // rank 0's host; 127.0.0.1 on one node
  int master_port = 0;               // 0: a free loopback port, new per attempt
  std::string backend = "auto";      // gloo: spawn ranks; mpi: hand to mpirun
  int max_restarts = 0;              // whole-job restarts after a failure
  double timeout_s = 0;              // wall-clock limit per attempt; 0: none
  std::string timeout_text;          // --timeout as written, for messages
  bool quiet_others = false;         // print only rank 0's output
  std::string trace_dir;             // --trace: COHORT_TRACE for the ranks, merged after
  std::vector<std::string> command;  // PROGRAM ARGS...

  int world_size() const { return nnodes * nproc_per_node; }
  bool elastic() const { return min_nproc < nproc_per_node; }
};

// A bad command line. main prints "cohortrun: <what>" and exits
// kUsageExitCode, before any rank starts.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr int kUsageExitCode = 2;

// Parses and validates argv. Returns nullopt when --help was printed.
// Throws UsageError.
std::optional<Options> parse_options(int argc, char** argv);

}  // namespace cohortrun
