// defines: HookWorker, the thread on which a communication hook runs its
// compressed collectives, so that a bucket's reduction overlaps the rest of
// backward instead of holding up the autograd thread.
//
// One FIFO thread per hook: buckets are launched in index order on every
// rank, so the worker issues their collectives in the same order everywhere
// (as the algorithms' executor and Gloo's async work do). While a job runs,
// the hook's communicator belongs to the worker; DDP waits for every bucket
// before it issues a collective of its own.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "cohort/core/work.h"

namespace cohort {

/// A thread that runs jobs in submission order and hands out a Work per job.
class HookWorker {
 public:
  HookWorker();
  /// Runs the jobs already submitted (the peers expect their traffic), then
  /// joins: every job is bounded by its communicator's timeout.
  ~HookWorker();
  HookWorker(const HookWorker&) = delete;
  HookWorker& operator=(const HookWorker&) = delete;

  /// Queues `job` behind every earlier one. The Work completes when the job
  /// has run; an exception it throws surfaces from wait() with `context`'s
  /// operation, rank and peers in front. After a job failed, later jobs are
  /// refused (the peers' state is unknown) with the first failure named.
  Work submit(OpContext context, std::function<void()> job);

  /// Blocks until every submitted job has run (for reading state the jobs
  /// write, such as a compressor's error feedback).
  void drain();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> queue_;
  bool running_ = false;  // a job is out of the queue and not finished
  bool stopping_ = false;
  std::string failure_;  // the first failed job's message
  std::thread thread_;   // last: starts after everything above exists
};

}  // namespace cohort
