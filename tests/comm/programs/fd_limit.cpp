// One rank of the descriptor-limit test (tests/comm/process_test.cpp),
// started with the torchrun environment: `fd_limit N` lowers this process's
// descriptor limit to N (as `ulimit -n N` does), then builds subgroups of
// every rank, one all_reduce each, until one fails. Prints "group G failed
// after S s: ERROR" and exits 3 on that failure; 0 if 64 groups were built,
// 2 on an error before the first group.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "cohort/cohort.h"
#include "comm/programs/programs.h"

namespace cohort::testing::programs {

int fd_limit(int argc, char** argv) {
  torch::set_num_threads(1);
  const rlimit limit{static_cast<rlim_t>(argc > 1 ? std::atoi(argv[1]) : 256),
                     static_cast<rlim_t>(argc > 1 ? std::atoi(argv[1]) : 256)};
  std::shared_ptr<Communicator> comm;
  try {
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) throw std::runtime_error("setrlimit failed");
    comm = init();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fd_limit: %s\n", e.what());
    return 2;
  }
  std::vector<int> all;
  for (int r = 0; r < comm->size(); ++r) all.push_back(r);
  std::vector<std::shared_ptr<Communicator>> groups;
  int g = 0;
  const auto start = std::chrono::steady_clock::now();
  try {
    for (; g < 64; ++g) {
      groups.push_back(comm->new_group(all));
      auto t = torch::ones({1024});
      groups.back()->all_reduce(t).wait();
    }
  } catch (const std::exception& e) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "group %d failed after %.1f s: %s\n", g, s, e.what());
    return 3;
  }
  return 0;
}

}  // namespace cohort::testing::programs
