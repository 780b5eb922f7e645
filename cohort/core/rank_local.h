// defines: mark_rank_local, the mark of a parameter that holds only this
// rank's part of a tensor split over ranks (an MoE's experts over its
// expert-parallel group, or each expert's FFN over its tensor-parallel
// group), and rank_local_refusal, the error of a mode that would take it for
// a replicated parameter.
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

/// The refusal of a mode that treats `params` as replicated: empty when none
/// is marked, else the first marked one (by its name in `names` where given,
/// its index otherwise), what it is part of and the remedy. The caller puts
/// itself and its rank in front.
std::string rank_local_refusal(const std::vector<torch::Tensor>& params,
                               const std::vector<std::string>& names = {});

}  // namespace cohort
