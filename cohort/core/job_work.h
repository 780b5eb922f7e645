// defines: JobWork, the Work of a job that a worker thread runs for the
// caller (the algorithms' executor, DDP's hook worker).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "cohort/core/error.h"
#include "cohort/core/work.h"

namespace cohort {

/// Finished by the worker (finish), waited for by the caller (wait). A wait
/// that times out after the job's own deadline gives the job `grace` more
/// (500 ms unless given): its own waits then fail with a better message
/// (the step and the peer, or the peers that stopped answering).
class JobWork : public WorkImpl {
 public:
  using Clock = std::chrono::steady_clock;  ///< the clock of `deadline`

  /// `what` names the job in a TimeoutError; `deadline` is when the job's
  /// own waits give up (the default: already past, so every wait gets the
  /// grace).
  explicit JobWork(std::string what, Clock::time_point deadline = Clock::time_point::min(),
                   Millis grace = Millis(500))
      : what_(std::move(what)), deadline_(deadline), grace_(grace) {}

  /// Called once by the worker: success (null) or the job's exception.
  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_ = true;
    cv_.notify_all();
  }

  /// True once finish() ran.
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  /// Blocks until finish() (rethrowing the job's exception) or the timeout
  /// (TimeoutError naming the job).
  void wait(Millis timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    bool done = cv_.wait_for(lock, timeout, [&] { return done_; });
    if (!done && Clock::now() >= deadline_) {
      done = cv_.wait_for(lock, grace_, [&] { return done_; });
    }
    if (!done) throw TimeoutError(what_ + " has not finished");
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::string what_;
  Clock::time_point deadline_;
  Millis grace_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace cohort
