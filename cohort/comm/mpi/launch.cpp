#include "cohort/comm/mpi/launch.h"

#include "cohort/comm/mpi/op.h"
#include "cohort/comm/mpi/runtime.h"
#include "cohort/comm/mpi/watchdog.h"
#include "cohort/core/env.h"
#include "cohort/core/error.h"
#include "cohort/core/store/tcp_store.h"

namespace cohort {
namespace {

// A blocking MPI call over the world, guarded by the watchdog.
template <typename F>
void watched(const std::string& what, int rank, Millis timeout, F&& call) {
  auto o = std::make_shared<mpi::MpiOp>(what + " (mpi_world) on world rank " + std::to_string(rank),
                                        timeout);
  mpi::Watchdog::instance().watch(o);
  int code;
  {
    mpi::MpiLock lock;
    code = call();
  }
  o->mark_finished();
  mpi::mpi_check(code, o->what());
}

}  // namespace

bool mpi_launched() {
  if (env::get("OMPI_COMM_WORLD_SIZE") || env::get("PMIX_RANK") || env::get("PMI_SIZE")) {
    return true;
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

MpiWorld mpi_world(Millis timeout) {
  mpi::ensure_mpi();
  MpiWorld w;
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);

  // One host when the shared-memory split holds everyone.
  MPI_Comm local = MPI_COMM_NULL;
  watched("MPI_Comm_split_type", w.rank, timeout, [&] {
    return MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &local);
  });
  int local_size = 0;
  MPI_Comm_size(local, &local_size);
  MPI_Comm_free(&local);

  std::string host = "127.0.0.1";
  if (local_size < w.size) {
    auto addr = env::get("COHORT_BIND_ADDR");
    if (!addr) addr = env::get("MASTER_ADDR");
    if (!addr) {
      throw ConfigError("cohort::init (mpi, world rank " + std::to_string(w.rank) +
                        "): the ranks span several hosts; set COHORT_BIND_ADDR (or MASTER_ADDR) "
                        "to an address of world rank 0's host for the store");
    }
    host = *addr;
  }

  // Rank 0 picks a free port; everyone learns it from rank 0.
  std::shared_ptr<TcpStore> server;
  int port = 0;
  if (w.rank == 0) {
    server = std::make_shared<TcpStore>(host, 0, true, timeout);
    port = server->port();
  }
  watched("MPI_Bcast of the store port", w.rank, timeout,
          [&] { return MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD); });
  w.store = server ? std::shared_ptr<Store>(server)
                   : std::make_shared<TcpStore>(host, static_cast<uint16_t>(port), false, timeout);
  return w;
}

}  // namespace cohort
