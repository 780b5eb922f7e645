// defines: verify_same_parameters, DDP's construction-time check that every
// rank holds the same parameters (count, dtypes, shapes, order).
//
// Without it a mismatch shows up much later as a hang or as garbage: the
// buckets would differ in size across ranks.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// Collective. Throws MismatchError on every rank naming the first parameter
/// that differs from rank 0's: its index, this rank's name for it, the
/// dtypes and shapes, and the two ranks.
void verify_same_parameters(Communicator& comm, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names);

}  // namespace cohort
