// defines: SerialWorker, the one job-queue thread of the library: the
// algorithms' executor, DDP's communication hooks and the UCX engine each
// run their collectives on one.
//
// Jobs run one at a time in submission order (every rank submits its
// collectives in the same order, so their traffic pairs up), on the worker's
// thread or, when asked and nothing is queued or running, on the caller's
// (run_here: a small collective costs less than the hand-off). After a job
// fails, every later one is refused without running, naming the first
// failure: the peers' state is unknown. The destructor runs the jobs already
// submitted (the peers expect their traffic), then joins; every job is
// bounded by its own timeout.
//
// Locking: `mu_` guards the queue, `busy_` and `stopping_`. `failure_` is
// touched only by whoever holds `busy_` (claimed under `mu_`), so a job
// never takes the lock to read it.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "cohort/core/error.h"
#include "cohort/core/job_work.h"

namespace cohort {

/// A thread that runs jobs in submission order and stops at the first failure.
class SerialWorker {
 public:
  using Clock = JobWork::Clock;  ///< the clock of a job's deadline

  /// How a worker refuses and idles.
  struct Options {
    /// A refused job's error: "<what>: refused, <refusal>: <first failure>".
    std::string refusal = "an earlier job failed";
    /// Run first on the worker's thread (e.g. to take over LibTorch's
    /// intra-op thread count).
    std::function<void()> on_start;
    /// Called, without the lock, while nothing can run: it must return within
    /// a bounded time or when `wake` is called (UCX progresses its transfers
    /// meanwhile). Empty: the thread sleeps on a condition variable.
    std::function<void()> idle;
    /// Ends an `idle` call early (with `idle` only).
    std::function<void()> wake;
  };

  /// Starts the thread.
  explicit SerialWorker(Options options);
  /// Runs the jobs already submitted, then joins.
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  /// Queues `job` behind every earlier one. The Work completes when the job
  /// has run, with its exception if it threw (a TimeoutError naming `what`
  /// when a wait outlasts `deadline` and `grace` more), or refused as above.
  std::shared_ptr<WorkImpl> submit(std::string what, Clock::time_point deadline,
                                   std::function<void()> job, Millis grace = Millis(500));

  /// Runs `job` now on the calling thread, as submit would run it, when
  /// nothing is queued or running, and returns true with `error` its
  /// exception (null when it succeeded). Returns false, running nothing,
  /// otherwise: then submit it.
  template <class F>
  bool run_here(std::string_view what, F& job, std::exception_ptr& error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (busy_ || !queue_.empty()) return false;
      busy_ = true;
    }
    error = guarded(what, job);
    bool queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      queued = !queue_.empty();
    }
    // Another thread queued a job meanwhile. Only then: a wake-up per call
    // would cost more than a small job.
    if (queued) wake();
    idle_.notify_all();
    return true;
  }

  /// Blocks until every submitted job has run (for reading state the jobs
  /// write).
  void drain();

 private:
  // Runs `job` unless an earlier one failed; records its failure.
  template <class F>
  std::exception_ptr guarded(std::string_view what, F& job) {
    if (!failure_.empty()) {
      return std::make_exception_ptr(
          PeerError(std::string(what) + ": refused, " + options_.refusal + ": " + failure_));
    }
    try {
      job();
      return nullptr;
    } catch (const std::exception& e) {
      failure_ = e.what();
      return std::current_exception();
    }
  }
  void wake();
  void loop();

  Options options_;
  std::mutex mu_;
  std::condition_variable wake_;  // without options_.idle: a job was queued, or stop
  std::condition_variable idle_;  // a job finished (drain)
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;  // a job is running (on either thread)
  bool stopping_ = false;
  std::string failure_;  // the first failed job's message; see the locking rule
  std::thread thread_;   // last: starts after everything above exists
};

}  // namespace cohort
