// One rank of the killed-mid-transfer tests (tests/comm/process_test.cpp),
// started with the torchrun environment: `dead_transfer large|burst|p2p`.
// Every rank keeps the wire busy (large: 64 MiB all_reduces, rendezvous
// sized; burst: 64 small all_reduces issued before the first is waited for;
// p2p: rank 0 sends 64 MiB to every other rank, which receive), and rank 1
// SIGKILLs itself from a second thread once its first collective has
// completed, so the kill lands while transfers are outstanding. A survivor
// prints its error on stderr, drops its communicator, calls finalize() and
// exits 3 (1 if it never saw an error, 2 on any other error): the test then
// reads its stderr for UCX's warnings about requests left at exit.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cohort/cohort.h"
#include "comm/programs/programs.h"

namespace cohort::testing::programs {

namespace {

// One round of the mode's traffic; returns when every transfer completed.
void round(Communicator& comm, const std::string& mode, std::vector<torch::Tensor>& ts) {
  const AllReduceOptions o{ReduceOp::Sum, std::chrono::seconds(3)};
  if (mode == "large") {
    comm.all_reduce(ts[0], o).wait();
  } else if (mode == "burst") {
    std::vector<Work> works;
    for (auto& t : ts) works.push_back(comm.all_reduce(t, o));
    for (auto& w : works) w.wait();
  } else if (comm.rank() == 0) {
    std::vector<Work> works;
    for (int r = 1; r < comm.size(); ++r) works.push_back(comm.send(ts[0], r));
    for (auto& w : works) w.wait();
  } else {
    comm.recv(ts[0], 0).wait();
  }
}

}  // namespace

int dead_transfer(int argc, char** argv) {
  torch::set_num_threads(1);
  const std::string mode = argc > 1 ? argv[1] : "large";
  std::vector<torch::Tensor> ts;
  if (mode == "burst") {
    for (int i = 0; i < 64; ++i) ts.push_back(torch::ones({256}));
  } else {
    ts.push_back(torch::ones({16 << 20}));  // 64 MiB
  }
  std::atomic<int> rounds{0};
  try {
    auto comm = init();
    if (comm->rank() == 1) {
      // The kill waits for nothing but the first round, so it lands inside
      // one of the next ones, which follow each other without a pause.
      std::thread([&] {
        while (rounds.load() < 1) std::this_thread::yield();
        ::raise(SIGKILL);
      }).detach();
    }
    try {
      for (;; ++rounds) round(*comm, mode, ts);
    } catch (const Error& e) {
      std::fprintf(stderr, "survivor error after %d rounds: %s\n", rounds.load(), e.what());
      comm.reset();
      try {
        finalize();
      } catch (const Error& f) {
        std::fprintf(stderr, "finalize: %s\n", f.what());
      }
      std::fflush(stderr);
      return 3;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dead_transfer: %s\n", e.what());
    return 2;
  }
  return 1;
}

}  // namespace cohort::testing::programs
