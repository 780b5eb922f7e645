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
  int nnodes = 1;                    // nodes in the job, each running cohortrun (MAX of MIN:MAX)
  int min_nnodes = 1;                // elastic across nodes: fewest nodes to go on with
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
  // --nnodes MIN:MAX (see rendezvous.h): the launchers agree on the members.
  std::string rdzv_id = "cohort";   // the job's id: launchers with the same id form one job
  double heartbeat_timeout_s = 15;  // a member silent this long is dropped
  double last_call_s = 3;           // once MIN nodes joined, wait this long for more
  double rdzv_timeout_s = 300;      // joining a generation fails after this long
  // Set per generation by the rendezvous: this node's first RANK and the
  // world (-1 / 0: node_rank * nproc_per_node and nnodes * nproc_per_node).
  int rank_base = -1;
  int world = 0;

  int world_size() const { return world > 0 ? world : nnodes * nproc_per_node; }
  int first_rank() const { return rank_base >= 0 ? rank_base : node_rank * nproc_per_node; }
  bool elastic() const { return min_nproc < nproc_per_node; }
  bool elastic_nodes() const { return min_nnodes < nnodes; }
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
