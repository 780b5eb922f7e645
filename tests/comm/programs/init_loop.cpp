// One rank of the init/finalize loop (tests/comm/process_test.cpp, and
// mpi_init_loop under mpirun): `init_loop CYCLES` runs init() -> all_reduce
// -> finalize() CYCLES times, as a job that rebuilds its default group
// would. Rank r contributes r + 1 + c in cycle c, so every rank must read
// size * (size + 1) / 2 + size * c. Exit 0 with "cycles N in S s" on
// stdout; 1 on a wrong sum, 2 on an exception (both naming the cycle).
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "cohort/cohort.h"
#include "comm/programs/programs.h"

namespace cohort::testing::programs {

int init_loop(int argc, char** argv) {
  torch::set_num_threads(1);
  const int cycles = argc > 1 ? std::atoi(argv[1]) : 100;
  const auto start = std::chrono::steady_clock::now();
  int c = 0;
  try {
    for (; c < cycles; ++c) {
      auto comm = init();
      const int n = comm->size();
      auto t = torch::full({256}, static_cast<float>(comm->rank() + 1 + c));
      comm->all_reduce(t).wait();
      const float expected = static_cast<float>(n * (n + 1) / 2 + n * c);
      if (!t.eq(expected).all().item<bool>()) {
        std::fprintf(stderr, "init_loop: cycle %d: rank %d read %f, expected %f\n", c, comm->rank(),
                     t[0].item<float>(), expected);
        return 1;
      }
      comm.reset();
      finalize();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "init_loop: cycle %d: %s\n", c, e.what());
    return 2;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("cycles %d in %.1f s\n", cycles, s);
  return 0;
}

}  // namespace cohort::testing::programs
