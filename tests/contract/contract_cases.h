// defines: the Communicator contract as data: every case written once, as a
// function of a communicator and a dtype, and run by every driver (ranks as
// threads over Gloo under every algorithm: tests/contract; processes under
// mpirun for MPI: tests/mpi). Expected values are the closed formulas of
// contract_values.h.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::testing {

struct ContractCase {
  std::string name;
  // Runs on every rank of `comm` (GoogleTest assertions report failures).
  void (*run)(Communicator& comm, torch::Dtype dtype);
  // Every dtype of kDtypes, or float32 only.
  bool every_dtype = true;
  // The case exercises all_reduce, reduce_scatter or all_gather, whose
  // algorithm can be chosen: drivers run it under every algorithm.
  bool algorithmic = false;
  // Skipped on smaller groups.
  int min_world = 1;
};

const std::vector<ContractCase>& contract_cases();
/// The cases on operations in flight (in_flight_cases.cpp), part of contract_cases().
std::vector<ContractCase> in_flight_cases();

}  // namespace cohort::testing
