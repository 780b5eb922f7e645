// cohortrun: starts the ranks of a cohort job on this node and supervises
// them. See USAGE.md.
#include <signal.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <system_error>

#include "attempt.h"
#include "cohort/core/store/socket.h"
#include "mpirun.h"
#include "node_supervisor.h"
#include "options.h"
#include "output.h"
#include "ports.h"
#include "process_tree.h"
#include "signal_fd.h"
#include "trace_files.h"

namespace cohortrun {
namespace {

// Exit code for the launcher's own failures (cannot fork, poll, ...).
constexpr int kInternalErrorExitCode = 1;

bool single_node(const Options& o) { return o.nnodes == 1; }

// Rank 0 binds MASTER_ADDR; a socket on 127.0.0.1 can stand in for it only
// when that is where the ranks connect.
bool hands_store_listener(const Options& o) {
  return single_node(o) && (o.master_addr == "127.0.0.1" || o.master_addr == "localhost");
}

// An explicit port that is taken would only surface later as a rendezvous
// timeout on every rank; refuse it up front instead.
void check_port(const Options& o) {
  if (single_node(o) && o.master_port != 0 && !loopback_port_free(o.master_port)) {
    throw UsageError("--master-port " + std::to_string(o.master_port) +
                     " is already in use on 127.0.0.1");
  }
}

// Launchers on one machine may share a loopback --master-addr, and on
// several machines each machine's would reach only its own. Nothing sent
// to a loopback address leaves the machine, so no launcher ever hears of
// one elsewhere: the misuse looks like the valid case, or like nodes that
// did not start yet. Said at start rather than refused.
void warn_loopback_master(const Options& o) {
  if (o.nnodes <= 1 || !cohort::net::is_loopback(o.master_addr)) return;
  log_line("warning: --master-addr " + o.master_addr +
           " is a loopback address: launchers on this machine can form the job, but nodes on "
           "other machines cannot reach it; " +
           (o.elastic_nodes() ? "they would run as separate jobs (each machine's launchers "
                                "hosting their own rendezvous)"
                              : "their ranks would wait for rank 0 on their own machine until "
                                "they time out") +
           ". Across machines, give node 0's address that every node reaches.");
}

// An interrupt that arrived after the last attempt ended (signals stay
// blocked, so it is pending here) must stop the launcher, not be
// forwarded to the ranks of a fresh attempt.
int pending_interrupt(SignalFd& signals) {
  for (int sig : signals.take()) {
    if (is_interrupt(sig)) return sig;
  }
  return 0;
}

// What the job does after a failed attempt: restart at the same size while
// the budget at this size lasts (--max-restarts), then, for an elastic job
// above its minimum, go on without the rank that failed: one rank fewer,
// a fresh budget. The ranks resume from their newest checkpoint.
class RestartPolicy {
 public:
  explicit RestartPolicy(const Options& options) : options_(options), current_(options) {}
  const Options& current() const { return current_; }

  // Whether the job runs again after `result`.
  bool wants_restart(const AttemptResult& result) const {
    if (restarts_at_size_ < options_.max_restarts) return true;
    // A timeout names no rank: dropping one at random would not help.
    return result.failed_rank >= 0 && current_.nproc_per_node > options_.min_nproc;
  }

  // Prepares the next attempt (after wants_restart) and says why on stderr.
  void next(const AttemptResult& result) {
    if (result.failed_rank >= 0) ++failures_[result.failed_rank];
    if (restarts_at_size_ < options_.max_restarts) {
      ++restarts_at_size_;
      log_line("restart " + std::to_string(restarts_at_size_) + "/" +
               std::to_string(options_.max_restarts) + " after " + result.cause);
      return;
    }
    --current_.nproc_per_node;
    const int times = failures_[result.failed_rank];
    log_line("rank " + std::to_string(result.failed_rank) + " failed " + std::to_string(times) +
             (times == 1 ? " time" : " times") + " (" + result.cause + "); restarting at world " +
             std::to_string(current_.world_size()) + " (min " + std::to_string(options_.min_nproc) +
             ") from the newest checkpoint");
    restarts_at_size_ = 0;
    failures_.clear();
  }

 private:
  const Options& options_;
  Options current_;  // the size the next attempt runs at
  int restarts_at_size_ = 0;
  std::map<int, int> failures_;  // rank -> failed attempts at this size
};

int supervise(const Options& options) {
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout reader must not kill us
  become_subreaper();
  SignalFd signals;
  RestartPolicy policy(options);
  for (int restart = 0;; ++restart) {
    // A port picked for us is fresh per attempt: the previous rank 0 may
    // have left it in a state the new one cannot bind. On loopback we keep
    // it listening and hand it to rank 0, so that no other process can take
    // it before rank 0 serves.
    StoreListener listener;
    int port = options.master_port;
    if (port == 0 && hands_store_listener(options)) {
      listener = listen_on_free_port();
      port = listener.port;
    } else if (port == 0) {
      port = pick_free_port();
    }
    AttemptResult result =
        Attempt(policy.current(), signals, restart, port, nullptr, std::move(listener.fd)).run();
    if (result.outcome == Outcome::kSucceeded) return 0;
    if (result.outcome == Outcome::kInterrupted || !policy.wants_restart(result)) {
      return result.exit_code;
    }
    if (int sig = pending_interrupt(signals)) return 128 + sig;
    policy.next(result);
  }
}

// --trace DIR: the ranks inherit COHORT_TRACE=DIR (absolute: a rank may
// change its directory). Rank files of an earlier job in DIR are removed so
// that the merge sees this job's ranks only.
void prepare_trace(const Options& o) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::absolute(o.trace_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) throw UsageError("--trace " + o.trace_dir + " is not a folder");
  static const std::regex stale(R"(rank-\d+\.json|trace\.json)");
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (std::regex_match(entry.path().filename().string(), stale)) fs::remove(entry.path(), ec);
  }
  ::setenv("COHORT_TRACE", dir.c_str(), 1);
}

void merge_trace(const Options& o) {
  try {
    const auto m = cohort_trace::merge_trace_dir(o.trace_dir);
    if (m.ranks == 0) {
      log_line("--trace: no rank wrote a trace into " + o.trace_dir);
    } else {
      log_line("trace of " + std::to_string(m.ranks) + " rank(s): " + o.trace_dir + "/trace.json" +
               cohort_trace::describe_missing(m.missing));
    }
  } catch (const std::exception& e) {
    log_line(std::string("--trace: ") + e.what());
  }
}

int run(int argc, char** argv) {
  std::optional<Options> options;
  try {
    options = parse_options(argc, argv);
    if (!options) return 0;  // --help
    check_port(*options);
    warn_loopback_master(*options);
  } catch (const UsageError& e) {
    log_line(e.what());
    return kUsageExitCode;
  }
  if (!options->trace_dir.empty()) {
    try {
      prepare_trace(*options);
    } catch (const std::exception& e) {
      log_line(e.what());
      return kUsageExitCode;
    }
  }
  // mpirun supervises the ranks: their files are merged with
  // `cohort-trace merge DIR`.
  if (options->backend == "mpi") return run_mpirun(*options);
  const int status = options->elastic_nodes() ? supervise_nodes(*options) : supervise(*options);
  if (!options->trace_dir.empty()) merge_trace(*options);
  return status;
}

}  // namespace
}  // namespace cohortrun

int main(int argc, char** argv) {
  try {
    return cohortrun::run(argc, argv);
  } catch (const std::exception& e) {
    cohortrun::log_line(std::string("internal error: ") + e.what());
    return cohortrun::kInternalErrorExitCode;
  }
}
