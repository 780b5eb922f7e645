// defines: Watchdog, the thread that ends the job when an MPI operation
// outlives its timeout.
//
// MPI cannot cancel a collective: a rank that never joins leaves the others
// blocked inside MPI for good. Work::wait(timeout) already turns that into a
// TimeoutError for a caller who waits; the watchdog covers what a waiter
// cannot: operations nobody waits on, blocking calls (communicator creation)
// and MPI_Finalize stuck behind them. When an operation is still unfinished
// `grace` after its timeout, it prints which operation on which rank and
// calls MPI_Abort, so the job ends with a clear message instead of hanging.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cohort/comm/mpi/op.h"

namespace cohort::mpi {

// The exit status a watchdog abort gives the job (mpirun passes it on).
inline constexpr int kWatchdogExitCode = 75;

class Watchdog {
 public:
  // The process's watchdog; its thread starts on first use.
  static Watchdog& instance();

  // Watches `op` until it finishes.
  void watch(std::shared_ptr<MpiOp> op);
  // Time between an operation's timeout and the abort: lets a caller that
  // got TimeoutError report it first (COHORT_MPI_ABORT_GRACE, seconds;
  // default 10 s).
  Millis grace() const { return grace_; }
  // Stops the thread (at exit, after MPI_Finalize).
  void stop();

 private:
  Watchdog();
  void run();
  [[noreturn]] void abort_job(const MpiOp& op);

  Millis grace_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<std::shared_ptr<MpiOp>> ops_;
  std::thread thread_;
};

}  // namespace cohort::mpi
