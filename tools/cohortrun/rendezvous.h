// defines: Rendezvous (the launchers of a --nnodes MIN:MAX job agreeing on
// who is in each generation of the job), Membership (one generation's answer
// for this node) and Watch (heartbeats and the end of a generation while the
// ranks run).
//
// As torchrun's c10d rendezvous: the launcher whose host is --master-addr
// hosts a store on --master-addr:--master-port (cohort's TcpStore server,
// hardened against what clients send); every launcher is its client. A
// generation is one run of the ranks at a fixed membership: nodes join it,
// the host closes it (MAX nodes, or MIN and --rdzv-last-call passed) and
// publishes the members, host first. While the ranks run, each launcher
// bumps a heartbeat counter; the host ends the generation when a member's
// counter stops (a dead or hung node), when a node is waiting to join and
// there is room, and any launcher ends it when its ranks fail. Everyone then
// joins the next generation: the lost node is not there, the waiting one is.
// Keys live under "cohortrun/<rdzv-id>/".
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cohort/core/store/tcp_store.h"
#include "options.h"

namespace cohortrun {

/// One generation's membership, as this node sees it.
struct Membership {
  int generation = 0;
  int slot = 0;       // this node's join ticket in the generation (1-based)
  int node_rank = 0;  // 0 is the host
  int nnodes = 0;
  int first_rank = 0;  // RANK of this node's local rank 0
  int world = 0;
  std::vector<int> member_slots;  // in node-rank order
};

/// Why a generation ended: a failure (it counts against --max-restarts), a
/// node lost (no heartbeat; counts too) or a node joining (does not count).
enum class EndKind { kFailure, kLost, kJoin };

/// The launchers' store and the join protocol. Throws cohort::TimeoutError
/// or cohort::PeerError (naming the store and what was waited for) when a
/// rendezvous does not complete or the host is gone.
class Rendezvous {
 public:
  explicit Rendezvous(const Options& options);
  bool is_host() const { return host_; }

  /// Joins `generation` (or the one open now when that is later, or when
  /// generation < 0) and returns once this node is a member of a closed one.
  Membership join(int generation);

  /// Ends `generation` with `cause` unless someone ended it first.
  void end(int generation, EndKind kind, const std::string& cause);
  /// Whether `generation` has ended; its kind and cause when it has.
  bool ended(int generation, EndKind* kind, std::string* cause);

  /// This node's ranks finished: the job is done for it.
  void report_done(const Membership& m);
  /// The host serves the store until every member is done (or silent past
  /// the heartbeat timeout), so that no member loses it mid-exit.
  void wait_for_members_done(const Membership& m);

  const Options& options() const { return options_; }
  /// The job's store token: COHORT_STORE_TOKEN, else the one the launchers
  /// of this machine share (a loopback --master-addr), else empty.
  const std::string& token() const { return token_; }
  cohort::TcpStore& store() { return *store_; }
  std::string key(int generation, const std::string& name) const;

 private:
  void connect_as_client(bool local);
  std::string close(int generation, int host_slot);
  int open_generation();
  int wait_for_later_generation(int generation);

  const Options& options_;
  bool host_ = false;
  std::string prefix_;
  std::string token_;
  std::unique_ptr<cohort::TcpStore> store_;
};

/// While the ranks run: a thread that heartbeats for this node, sets
/// `end_requested` once the generation ended, and on the host ends it when
/// a member goes silent or a node waits to join.
class Watch {
 public:
  Watch(Rendezvous& rdzv, const Membership& m);
  ~Watch();  // stops and joins the thread
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  const std::atomic<bool>& end_requested() const { return end_requested_; }

 private:
  void run();
  void host_checks();

  using Clock = std::chrono::steady_clock;
  Rendezvous& rdzv_;
  const Membership m_;
  std::map<int, std::pair<int64_t, Clock::time_point>> last_beat_;  // slot -> (count, seen)
  std::atomic<bool> end_requested_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cohortrun
