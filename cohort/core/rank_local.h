// defines: mark_rank_local, the mark of a parameter that holds only this
// rank's part of a tensor split over ranks (an MoE's experts over its
// expert-parallel group, or each expert's FFN over its tensor-parallel
// group), and rank_local_refusal, the error of a mode that would take it for
// a replicated parameter; and mark_tensor_parallel_part, the mark of a
// tensor-parallel layer's parameter with the TP rank whose part it holds,
// which those modes compare across their group at construction.
//
// DDP, FSDP, ZeRO, the fused optimizer, the all-reduce sync and a checkpoint
// without a mesh treat every parameter as one tensor replicated over their
// group: they broadcast rank 0's values, average the ranks' gradients, or
// save one rank's copy as the whole. On a rank-local part each of those is a
// silent wrong model (rank 1's experts replaced by rank 0's, different
// experts' gradients averaged, one rank's experts saved for all). Those modes
// sit below the layer that splits (expert_parallel), so they cannot see its
// type; the layer marks its parameters here, at the bottom, and they refuse
// what is marked.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

namespace cohort {

/// Marks `t` (its TensorImpl, for as long as it lives; `set_data` keeps the
/// mark) as this rank's part of a tensor split over ranks. `part_of` says
/// what it is part of, `remedy` what trains and saves it instead; the
/// refusals quote both.
void mark_rank_local(const torch::Tensor& t, std::string part_of, std::string remedy);

/// The part of a tensor split over a tensor-parallel group that a parameter
/// holds: TP rank `rank` of `size`, of the group named `group`. A tensor that
/// no layer marked holds {0, 1}: it is whole.
struct TensorParallelPart {
  int64_t rank = 0;
  int64_t size = 1;
  std::string group;
};

/// Marks `t` (its TensorImpl, as mark_rank_local) as TP rank `rank`'s part of
/// a tensor split over the group `group` of `size` ranks. A tensor-parallel
/// layer marks its split parameters; a mode that replicates them over a
/// group (DDP, ZeRO, FSDP) needs every rank of that group to hold the same
/// part, that is, the same TP rank: its group must be orthogonal to the TP
/// group (a mesh's "dp"). Nothing is marked at size 1.
void mark_tensor_parallel_part(const torch::Tensor& t, int64_t rank, int64_t size,
                               std::string group);

/// The mark of `t` ({0, 1} when none).
TensorParallelPart tensor_parallel_part(const torch::Tensor& t);

/// The refusal of a mode whose group holds other TP ranks' parts of the
/// parameter `param` ("parameter 'name'" or "parameter 3"): this rank holds
/// `mine`, rank `peer` of the mode's group `theirs`. The caller puts itself
/// and its rank in front.
std::string tensor_parallel_part_refusal(const std::string& param, const TensorParallelPart& mine,
                                         int peer, const TensorParallelPart& theirs);

/// The refusal of a mode that treats `params` as replicated: empty when none
/// is marked, else the first marked one (by its name in `names` where given,
/// its index otherwise), what it is part of and the remedy. The caller puts
/// itself and its rank in front.
std::string rank_local_refusal(const std::vector<torch::Tensor>& params,
                               const std::vector<std::string>& names = {});

}  // namespace cohort
