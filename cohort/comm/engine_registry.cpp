#include "cohort/comm/engine_registry.h"

#include <algorithm>

#include "cohort/comm/gloo/c10d_adapter.h"
#include "cohort/comm/mpi/launch.h"
#include "cohort/core/error.h"
#ifdef COHORT_WITH_MPI
#include "cohort/comm/mpi/mpi_engine.h"
#endif
#ifdef COHORT_WITH_UCX
#include "cohort/comm/ucx/ucx_engine.h"
#endif
#ifdef COHORT_WITH_NCCL
#include "cohort/comm/nccl/c10d_adapter.h"
#endif

namespace cohort {

#ifndef COHORT_WITH_MPI
// Built without MPI (COHORT_WITH_MPI=OFF, or CMake found no MPI): init()
// never picks it, and asking for it says so.
bool mpi_launched() { return false; }

MpiWorld mpi_world(Millis) {
  throw ConfigError(
      "cohort: backend 'mpi' is not available in this build (configure with "
      "-DCOHORT_WITH_MPI=ON and an MPI installation)");
}
#endif

std::vector<std::string> available_backends() {
  std::vector<std::string> built{"gloo"};
#ifdef COHORT_WITH_MPI
  built.push_back("mpi");
#endif
#ifdef COHORT_WITH_UCX
  built.push_back("ucx");
#endif
#ifdef COHORT_WITH_NCCL
  built.push_back("nccl");
#endif
  return built;
}

std::string resolve_auto_backend(std::string* why) {
#ifdef COHORT_WITH_UCX
  if (why) *why = "UCX is built (shared memory on a host, no launcher needed)";
  return "ucx";
#else
  if (why) *why = "this build has no UCX engine";
  return "gloo";
#endif
}

void require_backend(const std::string& backend, const std::string& where) {
  const auto built = available_backends();
  if (std::find(built.begin(), built.end(), backend) != built.end()) return;
  std::string known;
  for (auto& b : built) known += (known.empty() ? "" : ", ") + b;
  throw ConfigError(where + ": backend '" + backend +
                    "' is not available in this build (available: " + known + ")");
}

std::string default_backend() { return mpi_launched() ? "mpi" : "auto"; }

std::optional<LaunchedWorld> launched_world(const std::string& backend, Millis timeout) {
  if (backend != "mpi") return std::nullopt;
  auto mpi = mpi_world(timeout);
  return LaunchedWorld{mpi.rank, mpi.size, std::move(mpi.store)};
}

std::unique_ptr<Engine> create_engine(std::shared_ptr<Store> store, int rank, int size,
                                      const ConnectOptions& options) {
  if (options.backend == "gloo") {
    return make_gloo_engine(std::move(store), rank, size, options.gloo, options.timeout);
  }
#ifdef COHORT_WITH_MPI
  // MPI needs no rendezvous: ranks come from MPI_COMM_WORLD, and the store
  // serves only the communicator (debug checks, subgroup key spaces).
  if (options.backend == "mpi") return make_mpi_engine(rank, size, options.timeout);
#endif
#ifdef COHORT_WITH_UCX
  // UCX listens where Gloo would: the same bind address or interface.
  if (options.backend == "ucx") {
    return make_ucx_engine(std::move(store), rank, size, options.gloo.bind_address,
                           options.gloo.interface, options.timeout);
  }
#endif
#ifdef COHORT_WITH_NCCL
  // NCCL on the calling thread's current CUDA device; its own rendezvous
  // (the unique id) goes through the store.
  if (options.backend == "nccl") {
    return make_nccl_engine(std::move(store), rank, size, options.timeout);
  }
#endif
  require_backend(options.backend, "cohort");
  throw ConfigError("cohort: backend '" + options.backend + "' has no engine");
}

}  // namespace cohort
