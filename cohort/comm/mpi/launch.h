// defines: mpi_launched and mpi_world, how cohort::init() starts the default
// group under mpirun without RANK/WORLD_SIZE/MASTER_ADDR.
//
// No MPI types here: init.cpp includes this header in every build. With
// COHORT_WITH_MPI the definitions are in launch.cpp; without it
// engine_registry.cpp defines them as "not launched" / "not built".
#pragma once

#include <memory>

#include "cohort/core/store/store.h"
#include "cohort/core/types.h"

namespace cohort {

// True when this build has MPI and the process was started by an MPI
// launcher (Open MPI's OMPI_COMM_WORLD_SIZE, PMIx's PMIX_RANK, PMI_SIZE) or
// the application already called MPI_Init.
bool mpi_launched();

struct MpiWorld {
  int rank = 0;                  // MPI_COMM_WORLD rank
  int size = 1;                  // MPI_COMM_WORLD size
  std::shared_ptr<Store> store;  // shared by every rank (debug checks use it)
};

// Initializes MPI if needed and builds the world's store: rank 0 hosts a
// TcpStore on a free port and MPI_Bcast tells the others where. It listens on
// loopback when every rank shares one host, else on COHORT_BIND_ADDR or
// MASTER_ADDR (ConfigError when neither is set). Collective over
// MPI_COMM_WORLD.
MpiWorld mpi_world(Millis timeout);

}  // namespace cohort
