// defines: the tensor-parallel region mappings, each an autograd function
// whose backward is the conjugate collective of its forward (Megatron-LM's
// mappings):
//
//   copy_to_tensor_parallel_region      f: identity   | all-reduce
//   reduce_from_tensor_parallel_region  g: all-reduce | identity
//   scatter_to_tensor_parallel_region      split last dim | all-gather
//   gather_from_tensor_parallel_region     all-gather last dim | split
//   scatter_to_sequence_parallel_region    split dim 0 | all-gather
//   gather_from_sequence_parallel_region   all-gather dim 0 | reduce-scatter
//     (tensor_parallel_output_grad = false:   all-gather dim 0 | split)
//   reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0 | all-gather
//
// Each backward is the conjugate mapping, itself an autograd function, so
// gradients through them are differentiable again (backward with
// create_graph, e.g. a gradient penalty) and exact at every order.
//
// The communicator is the TP group; it must outlive the autograd graph (the
// layers hold it by shared_ptr). Backward runs its collective on the thread
// that calls backward(), in the graph's order, which is the same on every TP
// rank because every rank builds the same graph.
#pragma once

#include <torch/types.h>

#include "cohort/comm/communicator.h"

namespace cohort::tensor_parallel {

/// f: identity forward, all-reduce (sum) of the gradient over `group`.
torch::Tensor copy_to_tensor_parallel_region(const torch::Tensor& input, Communicator& group);
/// g: all-reduce (sum) forward over `group`, identity backward.
torch::Tensor reduce_from_tensor_parallel_region(const torch::Tensor& input, Communicator& group);
/// Keeps this rank's slice of the last dimension; backward all-gathers.
torch::Tensor scatter_to_tensor_parallel_region(const torch::Tensor& input, Communicator& group);
/// All-gathers along the last dimension; backward keeps this rank's slice.
torch::Tensor gather_from_tensor_parallel_region(const torch::Tensor& input, Communicator& group);
/// Keeps this rank's slice of dimension 0 (the sequence); backward all-gathers.
torch::Tensor scatter_to_sequence_parallel_region(const torch::Tensor& input, Communicator& group);
/// All-gathers along dimension 0. Backward, with tensor_parallel_output_grad
/// (Megatron-LM's name and default), reduce-scatters: the consumer of the
/// gathered tensor is tensor-parallel (a ColumnParallelLinear), each rank's
/// gradient is a partial sum, and each slice's gradient is their sum.
/// Without it, backward keeps this rank's slice of the gradient: the
/// consumer is replicated (a pooler or head computed alike on every TP rank),
/// every rank holds the whole gradient already, and a sum would multiply it
/// by the TP size.
torch::Tensor gather_from_sequence_parallel_region(const torch::Tensor& input, Communicator& group,
                                                   bool tensor_parallel_output_grad = true);
/// Reduce-scatters (sum) along dimension 0; backward all-gathers.
torch::Tensor reduce_scatter_to_sequence_parallel_region(const torch::Tensor& input,
                                                         Communicator& group);

/// The slice [rank * n / size, (rank + 1) * n / size) of `dim`; throws
/// InvalidArgument naming `what` when n does not divide by size.
torch::Tensor split_along(const torch::Tensor& t, int64_t dim, int rank, int size,
                          const std::string& what);

}  // namespace cohort::tensor_parallel
