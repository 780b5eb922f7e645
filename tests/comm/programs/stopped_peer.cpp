// One rank of the stopped-peer test (tests/comm/process_test.cpp), started
// with the torchrun environment: after a first all_reduce, rank 1 stops
// itself (SIGSTOP) and the others run a second all_reduce with a 3 s
// timeout. A survivor prints its error and exits 3 (1 if the all_reduce
// completed, 2 on any other error); the test then kills rank 1.
#include <signal.h>

#include <cstdio>

#include "cohort/cohort.h"

using namespace cohort;

int main() {
  torch::set_num_threads(1);
  try {
    auto comm = init();
    auto t = torch::ones({1024});
    comm->all_reduce(t).wait();
    if (comm->rank() == 1) ::raise(SIGSTOP);
    try {
      comm->all_reduce(t, {ReduceOp::Sum, std::chrono::seconds(3)}).wait();
    } catch (const Error& e) {
      std::fprintf(stderr, "survivor error: %s\n", e.what());
      return 3;
    }
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stopped_peer: %s\n", e.what());
    return 2;
  }
}
