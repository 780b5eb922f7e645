// defines: the expert-parallel exchanges over the "ep" group: the per-expert
// counts (a fixed-size all-to-all), and the rows themselves as an autograd
// function whose backward sends the gradients back along the reverse splits.
#pragma once

#include <torch/types.h>

#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::expert_parallel {

/// Collective over `group`. `counts` holds this rank's rows for each of the
/// E experts (E = group.size() * local experts, expert e on rank e / local);
/// returns [group.size(), local]: row s is what rank s sends to each of this
/// rank's experts.
torch::Tensor exchange_counts(const torch::Tensor& counts, Communicator& group);

/// As exchange_counts, with `words` from every rank (the same number on
/// each) riding in the same all-to-all (the MoE's refusal of its input and
/// its backward flags): returns the counts [group.size(), local] and every
/// rank's words, rank-major.
std::pair<torch::Tensor, std::vector<int64_t>> exchange_counts(const torch::Tensor& counts,
                                                               const std::vector<int64_t>& words,
                                                               Communicator& group);

/// Collective over `group`: rows [send_splits[p] of them for each rank p, in
/// rank order] go out, rows [recv_splits[s] from each rank s] come back.
/// Backward runs the reverse exchange (recv_splits out, send_splits in).
/// `anchor` (any tensor that requires grad on every rank, e.g. a slice of a
/// replicated parameter) keeps the function in the graph even on a rank whose
/// rows do not require grad, so that every rank joins the backward exchange;
/// it gets no gradient.
torch::Tensor all_to_all_rows(const torch::Tensor& rows, const torch::Tensor& anchor,
                              const std::vector<int64_t>& send_splits,
                              const std::vector<int64_t>& recv_splits, Communicator& group);

}  // namespace cohort::expert_parallel
