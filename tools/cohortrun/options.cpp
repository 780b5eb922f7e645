#include "options.h"

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>

#include "cohort/core/error.h"
#include "cohort/core/slurm.h"

namespace cohortrun {
namespace {

constexpr const char* kUsage =
    "Launches a cohort job, one process per rank.\n"
    "  cohortrun -n N|MIN:MAX [--nnodes M --node-rank K --master-addr A "
    "--master-port P]\n"
    "  cohortrun -n N --nnodes MIN:MAX --master-addr A --master-port P [--rdzv-id ID]\n"
    "            [--heartbeat-timeout S] [--rdzv-last-call S] [--rdzv-timeout S]\n"
    "            [--backend gloo|mpi|ucx|nccl|auto] [--max-restarts R] [--timeout S]\n"
    "            [--quiet-others] [--trace DIR] -- PROGRAM ARGS...";

// Ports and counts are taken as text and checked here, so that every bad
// value gets a message naming the flag instead of CLI11's generic one.
int parse_int(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < INT32_MIN || v > INT32_MAX) {
    throw UsageError(flag + " must be an integer (got '" + text + "')");
  }
  return static_cast<int>(v);
}

int parse_port(const std::string& text) {
  int port = parse_int("--master-port", text);
  if (port < 1 || port > 65535) {
    throw UsageError("--master-port must be in 1..65535 (got " + text + ")");
  }
  return port;
}

double parse_seconds(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v) || v <= 0) {
    throw UsageError(flag + " must be a positive number of seconds (got '" + text + "')");
  }
  return v;
}

double parse_timeout(const std::string& text) { return parse_seconds("--timeout", text); }

// N (MIN = MAX = N) or MIN:MAX with 1 <= MIN <= MAX, for `flag`.
void parse_range(const std::string& flag, const std::string& text, int& min, int& max) {
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    max = min = parse_int(flag, text);
    return;
  }
  min = parse_int(flag + " (MIN of MIN:MAX)", text.substr(0, colon));
  max = parse_int(flag + " (MAX of MIN:MAX)", text.substr(colon + 1));
  if (min < 1 || min > max) {
    throw UsageError(flag + " MIN:MAX needs 1 <= MIN <= MAX (got " + text + ")");
  }
}

// --nnodes M, or --nnodes MIN:MAX for a job whose nodes may leave and join
// (torchrun's --nnodes=MIN:MAX): the launchers rendezvous (rendezvous.h).
void parse_nnodes(const std::string& text, Options& o) {
  parse_range("--nnodes", text, o.min_nnodes, o.nnodes);
}

// What --nnodes MIN:MAX needs: the launchers' store on MASTER_ADDR:P and the
// ranks' on P+1, and node ranks that only the rendezvous assigns.
void validate_elastic_nodes(const Options& o, bool node_rank_given) {
  if (!o.elastic_nodes()) return;
  if (node_rank_given) {
    throw UsageError("--nnodes MIN:MAX assigns node ranks at each rendezvous: drop --node-rank");
  }
  if (o.elastic()) {
    throw UsageError("--nnodes MIN:MAX needs a fixed -n (ranks per node)");
  }
  if (o.master_port == 65535) {
    throw UsageError("--nnodes MIN:MAX uses --master-port P and P+1: P must be below 65535");
  }
  if (o.rdzv_id.empty() || o.rdzv_id.size() > 128 ||
      o.rdzv_id.find_first_of("/ \t\n") != std::string::npos) {
    throw UsageError("--rdzv-id must be 1 to 128 characters without '/' or spaces");
  }
}

constexpr int kMaxRanksPerNode = 1024;

// -n N, or -n MIN:MAX for an elastic job (torchrun's --nnodes=MIN:MAX, in
// ranks): it starts MAX ranks and may go on with as few as MIN.
void parse_nproc(const std::string& text, Options& o) {
  parse_range("-n", text, o.min_nproc, o.nproc_per_node);
}

// Inside a Slurm job step (`srun --ntasks-per-node=1 cohortrun ...`), the
// step says what the command line leaves open: its nodes are --nnodes,
// SLURM_NODEID is --node-rank, and the master and port are the library's
// (cohort/core/slurm.h: MASTER_ADDR/MASTER_PORT, else node 0's host, the
// step's first, and the job's port). Outside a step (a batch script) nothing is read: that
// one process is not one node of many.
void take_slurm_step(Options& o, bool nnodes_given, bool node_rank_given, bool port_given) {
  std::optional<cohort::slurm::Step> step;
  try {
    step = cohort::slurm::job_step();
  } catch (const cohort::ConfigError& e) {
    throw UsageError(std::string(e.what()) + " (cohortrun in a Slurm job step)");
  }
  if (!step) return;
  const int nodes = static_cast<int>(step->hosts.size());
  if (step->size != nodes) {
    throw UsageError("a Slurm job step of " + std::to_string(step->size) + " tasks on " +
                     std::to_string(nodes) +
                     " nodes: start one cohortrun per node (srun --ntasks-per-node=1)");
  }
  if (!nnodes_given) o.nnodes = o.min_nnodes = nodes;  // a fixed count, not MIN:MAX
  if (nodes == 1) return;  // one node: loopback and a free port, as without Slurm
  if (!node_rank_given) {
    const char* id = std::getenv("SLURM_NODEID");
    if (!id) throw UsageError("a Slurm job step on several nodes without SLURM_NODEID");
    o.node_rank = parse_int("SLURM_NODEID", id);
  }
  if (o.master_addr.empty()) o.master_addr = step->master_addr;  // node 0 serves: hosts[0]
  if (!port_given) o.master_port = step->master_port;
}

void validate(Options& o) {
  if (o.nproc_per_node <= 0) {
    throw UsageError("-n must be a positive number of ranks per node (got " +
                     std::to_string(o.nproc_per_node) + ")");
  }
  // Each rank is a process with two pipes to the launcher; past this a
  // typo (-n 100000) would fork until the machine gives out.
  if (o.nproc_per_node > kMaxRanksPerNode) {
    throw UsageError("-n must be at most " + std::to_string(kMaxRanksPerNode) +
                     " ranks per node (got " + std::to_string(o.nproc_per_node) + ")");
  }
  if (o.nnodes <= 0) {
    throw UsageError("--nnodes must be positive (got " + std::to_string(o.nnodes) + ")");
  }
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw UsageError("--node-rank " + std::to_string(o.node_rank) +
                     " is out of range for --nnodes " + std::to_string(o.nnodes) +
                     " (must be in 0.." + std::to_string(o.nnodes - 1) + ")");
  }
  if (o.elastic() && (o.nnodes > 1 || o.backend == "mpi")) {
    // Shrinking needs one supervisor that sees every rank: a node's
    // launcher cannot tell the others to restart smaller.
    throw UsageError(
        "-n MIN:MAX (an elastic job) supports a single node only, without --backend mpi");
  }
  if (o.max_restarts < 0) {
    throw UsageError("--max-restarts must be >= 0");
  }
  if (o.command.empty()) {
    throw UsageError(
        "missing program after '--' (usage: cohortrun -n N -- "
        "PROGRAM ARGS...)");
  }
  if (o.backend == "mpi") {
    // mpirun starts and supervises the ranks itself; options that only the
    // launcher's own supervision implements would be silently ignored.
    if (o.nnodes > 1) {
      throw UsageError(
          "--backend mpi supports a single node only; run "
          "mpirun with a hostfile for multi-node MPI jobs");
    }
    if (o.max_restarts > 0 || o.timeout_s > 0 || o.quiet_others) {
      throw UsageError(
          "--max-restarts, --timeout and --quiet-others are not "
          "supported with --backend mpi (mpirun supervises the "
          "ranks)");
    }
  } else if (o.backend != "gloo" && o.backend != "ucx" && o.backend != "nccl" &&
             o.backend != "auto") {
    throw UsageError("--backend (or COHORT_BACKEND) must be gloo, mpi, ucx, nccl or auto (got '" +
                     o.backend + "')");
  }
  if (o.nnodes > 1) {
    // Every node must agree on the rendezvous point; a default would let
    // each node silently pick its own.
    if (o.master_addr.empty()) {
      throw UsageError(
          "--master-addr is required when --nnodes > 1 (the "
          "address of node 0, reachable from every node)");
    }
    if (o.master_port == 0) {
      throw UsageError("--master-port is required when --nnodes > 1");
    }
  }
  if (o.master_addr.empty()) o.master_addr = "127.0.0.1";
}

}  // namespace

std::optional<Options> parse_options(int argc, char** argv) {
  Options o;
  // As init() does: a COHORT_BACKEND the caller exported holds unless --backend names another.
  if (const char* env = std::getenv("COHORT_BACKEND"); env && *env) o.backend = env;
  std::string nproc, nnodes, node_rank, port, restarts, heartbeat, last_call, rdzv_timeout;
  CLI::App app{kUsage, "cohortrun"};
  app.add_option("-n,--nproc-per-node", nproc,
                 "ranks to start on this node; MIN:MAX: start MAX, go on with fewer (>= MIN) "
                 "when a rank keeps failing")
      ->type_name("N|MIN:MAX");
  app.add_option("--nnodes", nnodes,
                 "number of nodes (default 1; in a Slurm step, its nodes); MIN:MAX: nodes may "
                 "leave (dropped at the next rendezvous) and join (admitted at the next restart)")
      ->type_name("M|MIN:MAX");
  app.add_option("--rdzv-id", o.rdzv_id,
                 "--nnodes MIN:MAX: the job's id; launchers with the same id form one job")
      ->type_name("ID");
  app.add_option("--heartbeat-timeout", heartbeat,
                 "--nnodes MIN:MAX: drop a node whose launcher is silent this long (default 15)")
      ->type_name("S");
  app.add_option("--rdzv-last-call", last_call,
                 "--nnodes MIN:MAX: once MIN nodes joined, wait this long for more (default 3)")
      ->type_name("S");
  app.add_option("--rdzv-timeout", rdzv_timeout,
                 "--nnodes MIN:MAX: give up when a rendezvous does not complete in time "
                 "(default 300)")
      ->type_name("S");
  app.add_option("--node-rank", node_rank, "this node's index (default 0; SLURM_NODEID)")
      ->type_name("K");
  app.add_option("--master-addr", o.master_addr,
                 "address of node 0 (default 127.0.0.1 on one node; the Slurm step's first)")
      ->type_name("ADDR");
  app.add_option("--master-port", port,
                 "rendezvous port (default: a free port on one node; the Slurm job's)")
      ->type_name("PORT");
  app.add_option("--backend", o.backend,
                 "auto (default, unless COHORT_BACKEND names another: ucx when built, else "
                 "gloo), gloo, mpi or ucx")
      ->type_name("NAME");
  app.add_option("--max-restarts", restarts,
                 "restart the job up to R times after a failure (default 0)")
      ->type_name("R");
  app.add_option("--timeout", o.timeout_text, "wall-clock limit in seconds for each attempt")
      ->type_name("S");
  app.add_flag("--quiet-others", o.quiet_others, "print only rank 0's output");
  app.add_option("--trace", o.trace_dir,
                 "each rank writes its timeline to DIR (COHORT_TRACE); merged into "
                 "DIR/trace.json when the ranks exit")
      ->type_name("DIR");
  // Stop at the program: its own flags must not be read as ours, with or
  // without a '--' in front of it.
  app.prefix_command();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }

  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    throw UsageError("unknown option '" + rest.front() + "'");
  }
  o.command = std::move(rest);

  if (nproc.empty()) {
    throw UsageError("-n (ranks per node) is required");
  }
  parse_nproc(nproc, o);
  if (!nnodes.empty()) parse_nnodes(nnodes, o);
  if (!node_rank.empty()) o.node_rank = parse_int("--node-rank", node_rank);
  if (!port.empty()) o.master_port = parse_port(port);
  if (!restarts.empty()) o.max_restarts = parse_int("--max-restarts", restarts);
  take_slurm_step(o, !nnodes.empty(), !node_rank.empty(), !port.empty());
  if (!o.timeout_text.empty()) o.timeout_s = parse_timeout(o.timeout_text);
  if (!heartbeat.empty()) o.heartbeat_timeout_s = parse_seconds("--heartbeat-timeout", heartbeat);
  if (!last_call.empty()) o.last_call_s = parse_seconds("--rdzv-last-call", last_call);
  if (!rdzv_timeout.empty()) o.rdzv_timeout_s = parse_seconds("--rdzv-timeout", rdzv_timeout);
  if (o.elastic_nodes()) {
    validate_elastic_nodes(o, !node_rank.empty());
    o.node_rank = 0;  // until the first rendezvous (a Slurm step's SLURM_NODEID does not hold)
  }
  validate(o);
  return o;
}

}  // namespace cohortrun
