// defines: run_ranks, which runs one function per rank on threads of this
// process, each rank with its own Communicator over one in-process store.
//
// This is how the test suites get breadth (world sizes 1..N, every dtype)
// without paying for processes; the process boundary has its own tests.
#pragma once

#include <functional>
#include <memory>
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

// Calls fn(comm) on `size` threads and joins them. If any rank throws, the
// first exception in time (the cause; the others are mostly its echo) is
// rethrown with the rank in its message.
void run_ranks(int size, const std::function<void(Communicator&)>& fn,
               const ThreadRanksOptions& options = {});

// Same, but hands each rank the shared_ptr (to keep or to build groups from).
// The thread holds its own reference until the body returns or throws, so a
// body that drops its copy closes the connections only when it returns.
void run_ranks_shared(int size, const std::function<void(std::shared_ptr<Communicator>)>& fn,
                      const ThreadRanksOptions& options = {});

}  // namespace cohort::testing
