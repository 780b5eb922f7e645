#include "cohort/comm/engine_registry.h"

#include "cohort/comm/error.h"
#include "cohort/comm/gloo/c10d_adapter.h"
#include "cohort/comm/mpi/launch.h"
#ifdef COHORT_WITH_MPI
#include "cohort/comm/mpi/mpi_engine.h"
#endif

namespace cohort {

#ifndef COHORT_WITH_MPI
// Built without MPI (COHORT_WITH_MPI=OFF, or CMake found no MPI): init()
// never picks it, and asking for it says so.
bool mpi_launched() { return false; }

MpiWorld mpi_world(Millis) {
  throw ConfigError("cohort: backend 'mpi' is not available in this build (configure with "
                    "-DCOHORT_WITH_MPI=ON and an MPI installation)");
}
#endif

std::vector<std::string> available_backends() {
#ifdef COHORT_WITH_MPI
  return {"gloo", "mpi"};
#else
  return {"gloo"};
#endif
}

std::unique_ptr<Engine> create_engine(std::shared_ptr<Store> store, int rank, int size,
                                      const ConnectOptions& options) {
  if (options.backend == "gloo") {
    GlooOptions g;
    g.bind_address = options.bind_address;
    g.interface = options.interface;
    g.timeout = options.timeout;
    return make_gloo_engine(std::move(store), rank, size, g);
  }
#ifdef COHORT_WITH_MPI
  // MPI needs no rendezvous: ranks come from MPI_COMM_WORLD, and the store
  // serves only the communicator (debug checks, subgroup key spaces).
  if (options.backend == "mpi") return make_mpi_engine(rank, size, options.timeout);
#endif
  std::string known;
  for (auto& b : available_backends()) known += (known.empty() ? "" : ", ") + b;
  throw ConfigError("cohort: backend '" + options.backend +
                    "' is not available in this build (available: " + known + ")");
}

}  // namespace cohort
