// defines: create_engine, the one place that knows which engines this build
// has. Optional engines (MPI, UCX, NCCL) are chosen here and nowhere else.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/init.h"

namespace cohort {

std::unique_ptr<Engine> create_engine(std::shared_ptr<Store> store, int rank, int size,
                                      const ConnectOptions& options);

// Engines compiled into this build, e.g. {"gloo", "mpi", "ucx", "nccl"}.
std::vector<std::string> available_backends();
// Throws ConfigError naming the available ones unless `backend` is one.
void require_backend(const std::string& backend, const std::string& where);

// What COHORT_BACKEND=auto means in this build: "ucx" when the UCX engine is
// built, else "gloo"; `why` (if given) receives the reason, for COHORT_DEBUG.
std::string resolve_auto_backend(std::string* why = nullptr);

// The backend init() uses when neither the caller nor COHORT_BACKEND names
// one: the one whose launcher started this process (mpirun: "mpi"), else
// "auto" (resolve_auto_backend).
std::string default_backend();

// Ranks and store given by `backend`'s own launcher (MPI: MPI_COMM_WORLD and
// a store it sets up); nullopt for engines that rendezvous through RANK,
// WORLD_SIZE and MASTER_ADDR (Gloo). Collective where the launcher is.
struct LaunchedWorld {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Store> store;
};
std::optional<LaunchedWorld> launched_world(const std::string& backend, Millis timeout);

}  // namespace cohort
