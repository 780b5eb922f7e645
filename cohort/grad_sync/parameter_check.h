// defines: verify_same_parameters, the construction-time check of DDP, ZeRO
// and the fused optimizer that every rank holds the same parameters (count,
// dtypes, shapes, order).
//
// Without it a mismatch shows up much later as a hang or as garbage: the
// buckets (or the flat partition) would differ in size across ranks.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// Collective. Throws MismatchError on every rank naming `who` (the class
/// that checks), the first parameter that differs from rank 0's (its index
/// and, where `names` has it, this rank's name for it), the dtypes and
/// shapes, and the two ranks. `names` may be empty.
void verify_same_parameters(Communicator& comm, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names,
                            const std::string& who = "DistributedDataParallel");

}  // namespace cohort
