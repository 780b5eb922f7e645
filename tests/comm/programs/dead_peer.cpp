// One rank of the killed-peer test (tests/comm/process_test.cpp), started
// with the torchrun environment: rank 1 SIGKILLs itself after the first
// collective; the survivors must get a named error within the timeout and
// exit 3 (1 if the second collective completed, 2 on any other error).
#include <signal.h>

#include <cstdio>

#include "cohort/cohort.h"
#include "comm/programs/programs.h"

namespace cohort::testing::programs {

int dead_peer(int argc, char** argv) {
  torch::set_num_threads(1);
  try {
    auto comm = init();
    auto t = torch::ones({1 << 16});
    comm->all_reduce(t).wait();
    if (comm->rank() == 1) ::raise(SIGKILL);
    try {
      comm->all_reduce(t, {ReduceOp::Sum, std::chrono::seconds(5)}).wait();
    } catch (const PeerError& e) {
      std::fprintf(stderr, "survivor error: %s\n", e.what());
      return 3;
    } catch (const TimeoutError& e) {
      std::fprintf(stderr, "survivor error: %s\n", e.what());
      return 3;
    }
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dead_peer: %s\n", e.what());
    return 2;
  }
}

}  // namespace cohort::testing::programs
