#include "cohort/comm/mpi/watchdog.h"

#include <cstdio>

#include "cohort/comm/mpi/runtime.h"
#include "cohort/core/env.h"

namespace cohort::mpi {
namespace {
// How often the watchdog looks. Deadlines are minutes in practice and the
// abort only needs to come, not to be punctual; 100 ms costs nothing.
constexpr Millis kTick{100};
// Above this many watched operations, finished ones are dropped at once
// rather than at the next tick (a tight loop of small operations).
constexpr size_t kCompactAbove = 1024;
}  // namespace

Watchdog& Watchdog::instance() {
  // Never destroyed: operations may be watched until the very end of the
  // process, after static destructors have started.
  static Watchdog* w = new Watchdog();
  return *w;
}

Watchdog::Watchdog()
    : grace_(env::timeout("COHORT_MPI_ABORT_GRACE").value_or(Millis(10000))),
      thread_([this] { run(); }) {}

void Watchdog::watch(std::shared_ptr<MpiOp> op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ops_.size() > kCompactAbove) {
    std::vector<std::shared_ptr<MpiOp>> live;
    for (auto& o : ops_) {
      if (!o->finished()) live.push_back(std::move(o));
    }
    ops_.swap(live);
  }
  ops_.push_back(std::move(op));
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    wake_.wait_for(lock, kTick, [this] { return stopping_; });
    if (stopping_) break;
    // Test outside mu_: testing takes the operation's lock and MpiLock, and
    // a thread that holds those may be about to call watch().
    std::vector<std::shared_ptr<MpiOp>> ops;
    ops.swap(ops_);
    lock.unlock();
    int finalized = 0;
    MPI_Finalized(&finalized);  // the application ended MPI: nothing left to guard
    const auto now = Clock::now();
    std::vector<std::shared_ptr<MpiOp>> live;
    for (auto& op : ops) {
      if (finalized || op->finished()) continue;
      // Only operations past their deadline are tested: the others are left
      // to their waiters, and an unfinished one is not a failure yet.
      if (now >= op->abort_at() && !op->try_test() && now >= op->abort_at()) {
        abort_job(*op);  // (a waiter may have pushed abort_at later meanwhile)
      }
      if (!op->finished()) live.push_back(std::move(op));
    }
    lock.lock();
    ops_.insert(ops_.end(), live.begin(), live.end());
  }
}

void Watchdog::abort_job(const MpiOp& op) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr,
               "cohort: MPI watchdog on world rank %d: %s did not complete within its "
               "timeout of %lld ms (+ %lld ms grace); aborting the job with MPI_Abort, as MPI "
               "cannot cancel an operation (a rank that never joined, or a mismatched call)\n",
               rank, op.what().c_str(), static_cast<long long>(op.timeout().count()),
               static_cast<long long>(grace_.count()));
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::abort();  // MPI_Abort does not return; this only satisfies [[noreturn]]
}

}  // namespace cohort::mpi
