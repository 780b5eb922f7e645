// defines: verify_same_parameters, the construction-time check of DDP, ZeRO
// and the fused optimizer that every rank holds the same parameters (count,
// dtypes, shapes, order) and that none is one rank's part of a split tensor,
// and verify_same_values, ZeRO's and the fused optimizer's check that they
// start from the same values.
//
// Without them a mismatch shows up much later as a hang or as garbage: the
// buckets (or the flat partition) would differ in size across ranks, or
// each rank would step its shard from its own values and the all-gather
// would silently assemble a model from several.
#pragma once

#include <torch/types.h>

#include <exception>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// Collective. Throws MismatchError on every rank naming `who` (the class
/// that checks), the first parameter that differs from rank 0's (its index
/// and, where `names` has it, this rank's name for it), the dtypes and
/// shapes, and the two ranks. `names` may be empty. A rank that cannot go
/// on passes its error as `refusal`: first, on every rank (at world size 1
/// too), that rank rethrows it and the others throw InvalidArgument naming
/// it, so that no rank is left waiting in the caller's next collective. A
/// parameter marked rank-local (core/rank_local.h: an MoE's experts split
/// over ranks) is such a refusal, an InvalidArgument naming it: every caller
/// takes its parameters for replicated over `comm`.
void verify_same_parameters(Communicator& comm, const std::vector<torch::Tensor>& params,
                            const std::vector<std::string>& names,
                            const std::string& who = "DistributedDataParallel",
                            std::exception_ptr refusal = nullptr);

/// Collective (one all-gather of one word per rank; none at world size 1):
/// throws InvalidArgument on every rank when any rank's `params` hold a
/// parameter marked rank-local (core/rank_local.h), for a caller that takes
/// them for replicated over `comm` and needs no other check (the all-reduce
/// sync, a pipeline's wiring). The refusing rank names the parameter, the
/// others the refusing ranks.
void verify_not_rank_local(Communicator& comm, const std::vector<torch::Tensor>& params,
                           const std::vector<std::string>& names, const std::string& who);

/// Collective (one all-gather of one word per rank, a second of a word per
/// parameter only when they differ; none at world size 1): throws
/// MismatchError on every rank unless every rank's `params` hold the same
/// values, bit for bit (compared by a 64-bit content digest, about 20 GB/s
/// a core; a parameter on a GPU is copied to the host for it, one at a
/// time). The message names `who`, the first parameter whose values differ
/// (its index and, where `names` has it, its name), the groups of ranks
/// that agree on it, and `remedy`. Call it after verify_same_parameters
/// (the shapes must agree).
void verify_same_values(Communicator& comm, const std::vector<torch::Tensor>& params,
                        const std::vector<std::string>& names, const std::string& who,
                        const std::string& remedy);

}  // namespace cohort
