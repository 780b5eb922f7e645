// defines: create_engine, the one place that knows which engines this build
// has. Optional engines (MPI, NCCL) are chosen here and nowhere else.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/init.h"

namespace cohort {

std::unique_ptr<Engine> create_engine(std::shared_ptr<Store> store, int rank, int size,
                                      const ConnectOptions& options);

// Engines compiled into this build, e.g. {"gloo", "mpi"}.
std::vector<std::string> available_backends();

}  // namespace cohort
