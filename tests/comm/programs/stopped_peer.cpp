// One rank of the stopped-peer tests (tests/comm/process_test.cpp, and
// under mpirun tests/mpi/watchdog_test.cpp), started with the torchrun
// environment or by mpirun: after a first all_reduce, the ranks given as
// arguments (rank 1 when none is) print "stopping pid N" and stop
// themselves (SIGSTOP), and the others run a second all_reduce with a 3 s
// timeout. With --inside, the stopping ranks stop just after issuing that
// all_reduce themselves (16 MiB, so it is still running): inside the
// engine's own collective, past its signature check. A survivor prints its
// error on stdout and exits 3 (1 if the all_reduce completed, 2 on any
// other error); the test then kills the stopped ranks. Under mpirun a rank
// that exits ends the whole job, perhaps before the other survivors have
// printed: with --hold a survivor waits for the job's end instead (mpirun
// ends it once the test kills the stopped ranks), at most 60 s. With --kill
// the ranks SIGKILL themselves instead of stopping.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "cohort/cohort.h"
#include "comm/programs/programs.h"

namespace cohort::testing::programs {

// Waits up to 60 s for SIGTERM or SIGINT (mpirun's end of the job).
void hold() {
  sigset_t ending;
  sigemptyset(&ending);
  sigaddset(&ending, SIGTERM);
  sigaddset(&ending, SIGINT);
  pthread_sigmask(SIG_BLOCK, &ending, nullptr);
  const timespec limit{60, 0};
  sigtimedwait(&ending, nullptr, &limit);
}

int stopped_peer(int argc, char** argv) {
  torch::set_num_threads(1);
  std::set<int> stopping;
  bool inside = false, holds = false, kills = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--inside") {
      inside = true;
    } else if (std::string(argv[i]) == "--hold") {
      holds = true;
    } else if (std::string(argv[i]) == "--kill") {
      kills = true;
    } else {
      stopping.insert(std::atoi(argv[i]));
    }
  }
  if (stopping.empty()) stopping.insert(1);
  try {
    auto comm = init();
    auto t = torch::ones({1024});
    comm->all_reduce(t).wait();
    const bool stops = stopping.count(comm->rank()) > 0;
    auto stop = [kills] {
      std::printf("%s pid %d\n", kills ? "killing" : "stopping", static_cast<int>(::getpid()));
      std::fflush(stdout);
      ::raise(kills ? SIGKILL : SIGSTOP);
    };
    if (stops && !inside) stop();
    if (inside) t = torch::ones({4 << 20});
    try {
      auto work = comm->all_reduce(t, {ReduceOp::Sum, std::chrono::seconds(3)});
      if (stops) stop();
      work.wait();
    } catch (const Error& e) {
      std::printf("survivor error: %s\n", e.what());
      std::fflush(stdout);  // before exit: MPI_Finalize may wait for the stopped rank
      if (holds) hold();
      // Inside, the engine's own threads are still in the collective the
      // stopped rank holds, and tearing the group down waits for the
      // engine's own timeout (COHORT_TIMEOUT): the error is what is tested.
      if (inside) std::_Exit(3);
      return 3;
    }
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stopped_peer: %s\n", e.what());
    return 2;
  }
}

}  // namespace cohort::testing::programs
