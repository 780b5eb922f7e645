#include "node_supervisor.h"

#include <signal.h>

#include <cstdlib>
#include <exception>
#include <string>

#include "attempt.h"
#include "output.h"
#include "process_tree.h"
#include "rendezvous.h"
#include "signal_fd.h"

namespace cohortrun {
namespace {

// An interrupt that arrived while the launcher was in a rendezvous (signals
// stay blocked, so it is pending): stop rather than start ranks.
int pending_interrupt(SignalFd& signals) {
  for (int sig : signals.take()) {
    if (is_interrupt(sig)) return sig;
  }
  return 0;
}

std::string describe(const Membership& m, int nproc) {
  return "generation " + std::to_string(m.generation) + ": node " + std::to_string(m.node_rank) +
         " of " + std::to_string(m.nnodes) + ", ranks " + std::to_string(m.first_rank) + ".." +
         std::to_string(m.first_rank + nproc - 1) + " of world " + std::to_string(m.world);
}

// The ranks' store token for a generation: a rank left over from an earlier
// generation (a node that hung and woke up) cannot reach the store of the
// next one on the same port, nor disturb its rendezvous.
void set_generation_token(const std::string& job_token, int generation) {
  const std::string token =
      (job_token.empty() ? "" : job_token + ".") + "generation-" + std::to_string(generation);
  ::setenv("COHORT_STORE_TOKEN", token.c_str(), 1);
}

// Runs this node's ranks for one generation, heartbeating meanwhile.
// COHORT_RESTART_COUNT is the generation, the same on every node (a node
// that joins late starts at the job's count, not at 0).
AttemptResult run_generation(Rendezvous& rdzv, const Membership& m, const Options& options,
                             SignalFd& signals) {
  set_generation_token(rdzv.token(), m.generation);
  Options current = options;
  current.node_rank = m.node_rank;
  current.rank_base = m.first_rank;
  current.world = m.world;
  Watch watch(rdzv, m);
  // Rank 0 runs on the host (--master-addr) and serves the ranks' store on
  // the next port: the launchers' store keeps --master-port.
  return Attempt(current, signals, m.generation, options.master_port + 1, &watch.end_requested())
      .run();
}

int supervise(Rendezvous& rdzv, const Options& options, SignalFd& signals) {
  int failures = 0;
  int generation = -1;
  for (;;) {
    const Membership m = rdzv.join(generation);
    const std::string node = "node " + std::to_string(m.node_rank);
    if (int sig = pending_interrupt(signals)) {
      rdzv.end(m.generation, EndKind::kFailure, node + " was interrupted");
      return 128 + sig;
    }
    log_line(describe(m, options.nproc_per_node));
    const AttemptResult result = run_generation(rdzv, m, options, signals);
    if (result.outcome == Outcome::kSucceeded) {
      rdzv.report_done(m);
      if (rdzv.is_host()) rdzv.wait_for_members_done(m);
      return 0;
    }
    if (result.outcome == Outcome::kInterrupted) {
      // This node leaves; the others go on without it.
      rdzv.end(m.generation, EndKind::kFailure, node + " " + result.cause);
      return result.exit_code;
    }
    EndKind kind = EndKind::kFailure;
    std::string cause;
    // The first cause counts: ranks that fail because a peer node vanished
    // do so after the generation ended.
    if (!rdzv.ended(m.generation, &kind, &cause)) {
      cause = node + ": " + result.cause;
      rdzv.end(m.generation, kind, cause);
    }
    if (kind != EndKind::kJoin) {
      if (failures >= options.max_restarts) {
        log_line("generation " + std::to_string(m.generation) + " ended (" + cause +
                 "); no restarts left (--max-restarts " + std::to_string(options.max_restarts) +
                 ")");
        return result.exit_code != 0 ? result.exit_code : 1;
      }
      ++failures;
    }
    log_line("generation " + std::to_string(m.generation) + " ended (" + cause + "); " +
             (kind == EndKind::kJoin ? std::string("a join is no failure")
                                     : "restart " + std::to_string(failures) + "/" +
                                           std::to_string(options.max_restarts)) +
             ": joining the next rendezvous");
    if (int sig = pending_interrupt(signals)) return 128 + sig;
    generation = m.generation + 1;
  }
}

}  // namespace

int supervise_nodes(const Options& options) {
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout reader must not kill us
  become_subreaper();
  SignalFd signals;
  try {
    Rendezvous rdzv(options);
    if (rdzv.is_host()) {
      log_line("rendezvous: hosting the store on " + options.master_addr + ":" +
               std::to_string(options.master_port));
    }
    return supervise(rdzv, options, signals);
  } catch (const std::exception& e) {
    // The store (the host) is gone, hung, or a rendezvous timed out.
    log_line(std::string("rendezvous failed: ") + e.what());
    return 1;
  }
}

}  // namespace cohortrun
