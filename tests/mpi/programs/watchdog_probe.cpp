// A two-rank job in which rank 1 never joins a collective; run by
// mpi_launch_tests under mpirun with COHORT_TIMEOUT=2 and
// COHORT_MPI_ABORT_GRACE=1.
//
// Rank 0 issues an all_reduce and waits: it gets TimeoutError, prints it
// and how long the wait took,
// then blocks in MPI like an application stuck behind the lost peer. Rank 1
// blocks in a receive nobody answers. Only rank 0's watchdog can end the
// job: it must abort it with a message naming the operation and the rank.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <cstdio>

#include "cohort/cohort.h"

int main() {
  auto world = cohort::init();  // no options: MPI is found from mpirun's environment
  std::fprintf(stderr, "probe: rank %d of %d, backend %s\n", world->rank(), world->size(),
               world->backend().c_str());
  int token = 0;
  if (world->rank() == 0) {
    auto t = torch::ones({16});
    const auto start = std::chrono::steady_clock::now();
    try {
      world->all_reduce(t).wait();
      std::fprintf(stderr, "probe: all_reduce finished without rank 1\n");
      return 0;
    } catch (const cohort::TimeoutError& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - start);
      std::fprintf(stderr, "probe: rank 0 caught TimeoutError after %lld ms: %s\n",
                   static_cast<long long>(ms.count()), e.what());
    }
    MPI_Recv(&token, 1, MPI_INT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  } else {
    MPI_Recv(&token, 1, MPI_INT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  std::fprintf(stderr, "probe: rank %d was released, which nothing should do\n", world->rank());
  return 0;
}
