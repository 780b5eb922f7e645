// defines: make_mpi_engine, the door to the MPI engine (built only with
// COHORT_WITH_MPI; engine_registry.cpp is the one caller).
#pragma once

#include <memory>

#include "cohort/core/engine.h"

namespace cohort {

// An engine over a private duplicate of MPI_COMM_WORLD (so cohort's traffic
// never matches the application's own MPI calls). Initializes MPI when the
// application has not. `rank` and `size` must be this process's place in
// MPI_COMM_WORLD; anything else is a ConfigError (start the job with mpirun).
std::unique_ptr<Engine> make_mpi_engine(int rank, int size, Millis timeout);

}  // namespace cohort
