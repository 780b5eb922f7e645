// defines: run_ranks, which runs one function per rank on threads of this
// process, each rank with its own Communicator over one in-process store.
//
// This is how the test suites get breadth (world sizes 1..N, every dtype)
// without paying for processes; the process boundary has its own tests.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cohort/cohort.h"

namespace cohort::testing {

// Every rank's ConnectOptions, with a short default timeout: a broken test
// fails, never hangs.
struct ThreadRanksOptions : ConnectOptions {
  ThreadRanksOptions() { timeout = std::chrono::seconds(20); }
  // Rank -> node name (CommunicatorOptions::node), to fake several hosts.
  std::function<std::string(int)> node_of;
};

// Calls fn(comm) on `size` threads and joins them.
// With COHORT_TEST_RANKS=processes, a size above 1 instead runs fn once,
// in this process, on the world that cohortrun started (init() on first
// use; it must have `size` ranks): a test written for threads then runs
// with ranks as processes, where threads cannot work. On one GPU,
// LibTorch runs every thread's CUDA backward on one thread per device, so
// a rank whose backward waits for a peer's collective blocks that peer's
// backward too (scripts/gpu-check.sh). Only for tests that check each
// rank's results inside fn: a test that collects every rank's results and
// checks them after the call would see this rank's alone. Options other
// than the timeout (the engine, node names) are the world's. If any rank throws, the
// first exception in time (the cause; the others are mostly its echo) is
// rethrown with the rank in its message.
void run_ranks(int size, const std::function<void(Communicator&)>& fn,
               const ThreadRanksOptions& options = {});

// Same, but hands each rank the shared_ptr (to keep or to build groups from).
// The thread holds its own reference until the body returns or throws, so a
// body that drops its copy closes the connections only when it returns.
void run_ranks_shared(int size, const std::function<void(std::shared_ptr<Communicator>)>& fn,
                      const ThreadRanksOptions& options = {});

// Runs fn on every rank as run_ranks_shared does and returns each rank's
// result, by rank, for checks after the call (so under
// COHORT_TEST_RANKS=processes it holds this process's rank alone).
template <class T>
std::map<int, T> results_of_ranks(int size,
                                  const std::function<T(std::shared_ptr<Communicator>)>& fn,
                                  const ThreadRanksOptions& options = {}) {
  std::mutex mu;
  std::map<int, T> out;
  run_ranks_shared(
      size,
      [&](std::shared_ptr<Communicator> comm) {
        T result = fn(comm);
        std::lock_guard<std::mutex> lock(mu);
        out.insert_or_assign(comm->rank(), std::move(result));
      },
      options);
  return out;
}

}  // namespace cohort::testing
