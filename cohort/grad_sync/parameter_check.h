// defines: verify_same_parameters, the construction-time check of DDP, ZeRO
// and the fused optimizer that every rank holds the same parameters (count,
// dtypes, shapes, order) and that none is one rank's part of a split tensor,
// and verify_same_values, ZeRO's and the fused optimizer's check that they
// start from the same values. Both construction checks also refuse a group
// whose ranks hold different tensor-parallel ranks' parts of a parameter.
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
/// shapes, and the two ranks. With the same shapes everywhere, throws
/// InvalidArgument on every rank when a parameter split over TP holds other
/// TP ranks' parts on the ranks of `comm` (core/rank_local.h): a group that
/// crosses the TP group, whose broadcast and average would mix the parts
/// (as refuse_mixed_tensor_parallel_parts; the parts travel with the shapes,
/// no other collective). `names` may be empty. A rank that cannot go
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

/// The TP part (core/rank_local.h) of each of `params`: its TP rank and TP
/// size, two words each ({0, 1} for a whole tensor). Ranks whose group
/// replicates `params` must agree on them.
std::vector<int64_t> tensor_parallel_words(const std::vector<torch::Tensor>& params);

/// Collective (one all-gather of two words per rank; none at world size 1),
/// for a caller that replicates `params` over `comm` and has no
/// verify_same_parameters (the all-reduce sync): refuses as
/// refuse_mixed_tensor_parallel_parts (a second all-gather, only then) when
/// the ranks' TP parts differ; MismatchError on every rank when they hold
/// different numbers of parameters.
void verify_same_tensor_parallel_parts(Communicator& comm, const std::vector<torch::Tensor>& params,
                                       const std::vector<std::string>& names,
                                       const std::string& who);

/// Collective (one all-gather of two words per parameter), for ranks that
/// hold the same number of parameters and found (by a digest of
/// tensor_parallel_words) that their TP parts differ: throws InvalidArgument
/// on every rank naming `who`, this rank, the first parameter whose parts
/// differ (by its name in `names`, or its index), the first rank that holds
/// another TP rank's part of it, and the mesh's dp group as the remedy.
/// Returns when the parts agree.
void refuse_mixed_tensor_parallel_parts(Communicator& comm,
                                        const std::vector<torch::Tensor>& params,
                                        const std::vector<std::string>& names,
                                        const std::string& who);

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
