// defines: sequence_mean_loss, the mean of per-token losses over the
// counted tokens of sequences split across the context-parallel group.
//
// The cp ranks hold different tokens of the same sequences, and ignored
// targets (padding, masking) leave them different numbers of counted
// tokens; the mean of the ranks' own means then weights a rank's tokens by
// 1 / its count, not 1 / the sequence's. This sums the losses and the counts
// over the group first (as Megatron-LM does).
#pragma once

#include <torch/types.h>

#include "cohort/comm/communicator.h"

namespace cohort::context_parallel {

/// Σ losses / Σ counted over every rank of `cp_group`, this rank's
/// `token_losses` (floating point) where its `counted` (bool, the same
/// shape) is true. Every rank returns that value (NaN when no rank counts a
/// token, as LibTorch's mean; a rank that counts none returns it too).
///
/// The gradient assumes the gradients are then averaged over the group (as
/// GradientSynchronizer averages over "cp"): a rank's backward carries its
/// own tokens at weight cp / Σ counted, so the average over the cp ranks is
/// the gradient of the sequence's mean. A plain sum over the group would be
/// cp times too large.
///
/// Collective over `cp_group`: one all-reduce of 2 + cp doubles. A rank
/// whose arguments do not fit is an InvalidArgument on every rank, naming
/// it, after that all-reduce.
torch::Tensor sequence_mean_loss(const torch::Tensor& token_losses, const torch::Tensor& counted,
                                 Communicator& cp_group);

}  // namespace cohort::context_parallel
