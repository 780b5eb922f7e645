// defines: Attempt — one run of the local part of the job: start the ranks,
// forward their output, watch for a failed rank, an interrupt or the
// timeout, and tear every rank's processes down.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "exit_status.h"
#include "fd.h"
#include "options.h"
#include "rank_output.h"
#include "signal_fd.h"

namespace cohortrun {

// kEnded: the job's generation ended elsewhere (--nnodes MIN:MAX), and the
// ranks were stopped for the next rendezvous.
enum class Outcome { kSucceeded, kRankFailed, kTimedOut, kInterrupted, kEnded };

struct AttemptResult {
  Outcome outcome = Outcome::kSucceeded;
  int exit_code = 0;     // the launcher's exit code if it stops after this
  std::string cause;     // "rank 1 exited with code 3", for the restart log
  int failed_rank = -1;  // the first rank that failed, when one did
};

class Attempt {
 public:
  using Clock = std::chrono::steady_clock;
  // Between the polite signal and SIGKILL: time for ranks to flush and exit.
  static constexpr std::chrono::seconds kGrace{3};
  // After SIGKILL, how long to wait for pipes to close before giving up on
  // a process that escaped its group and still holds one.
  static constexpr std::chrono::seconds kKillWait{2};

  // `end_requested` (optional): once it turns true, the ranks are stopped
  // and the attempt ends with Outcome::kEnded. `store_listener` (optional):
  // a socket listening on master_port, handed to rank 0 for its store and
  // closed here once rank 0 is started.
  Attempt(const Options& options, SignalFd& signals, int restart, int master_port,
          const std::atomic<bool>* end_requested = nullptr, UniqueFd store_listener = {});
  Attempt(const Attempt&) = delete;
  Attempt& operator=(const Attempt&) = delete;

  // Returns once every rank is reaped and its output drained.
  AttemptResult run();

 private:
  // kRunning: watching. kTerminating: a signal went to every rank's group,
  // waiting for them until kGrace. kKilling: SIGKILL sent. kAbandoned: the
  // remains did not close their pipes in time; stop waiting.
  enum class Phase { kRunning, kTerminating, kKilling, kAbandoned };

  struct Rank {
    Rank(int rank, bool shown) : rank(rank), output(rank, shown) {}
    int rank;
    pid_t pid = -1;  // also its process group id
    bool running = false;
    ExitStatus status;
    UniqueFd out;
    UniqueFd err;
    RankOutput output;
  };

  void spawn_all();
  void wait_for_events();
  void read_output(Rank& rank, Stream stream);
  void on_signals();
  void on_interrupt(int sig);
  void reap();
  void on_rank_exit(size_t index, int status);
  void check_deadlines();
  void on_timeout();
  void begin_teardown(int sig);
  void kill_all();
  void signal_groups(int sig);
  bool any_running() const;
  bool finished() const;
  int poll_timeout_ms() const;
  AttemptResult result() const;

  const Options& options_;
  SignalFd& signals_;
  const int restart_;
  const int master_port_;
  UniqueFd store_listener_;
  const std::atomic<bool>* end_requested_;
  bool ended_ = false;
  std::vector<Rank> ranks_;
  Phase phase_ = Phase::kRunning;
  Clock::time_point job_deadline_ = Clock::time_point::max();
  Clock::time_point phase_deadline_ = Clock::time_point::max();
  int failed_ = -1;  // index in ranks_ of the first rank that failed
  bool timed_out_ = false;
  int interrupt_ = 0;  // the first SIGINT/SIGTERM/SIGHUP received
  std::string spawn_error_;
};

}  // namespace cohortrun
