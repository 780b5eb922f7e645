// defines: the FSDP × TP tests' model (two Megatron MLP blocks over a TP
// group and a replicated head, each block a unit when sharded) and the slice
// of a one-process tensor that a TP rank holds. Shared by
// tests/fsdp/fsdp_tp_test.cpp and the Trainer's tests of TP models.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/tensor_parallel/layers.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::fsdp_tp {

inline constexpr int64_t kWidth = 10, kHidden = 20;  // 20 / tp rows: 10 at tp 2, uneven over dp 3

// A Megatron MLP block with a residual: x + Row(tanh(Column(x))).
struct TpBlockImpl : torch::nn::Module {
  tensor_parallel::ColumnParallelLinear col{nullptr};
  tensor_parallel::RowParallelLinear row{nullptr};
  TpBlockImpl(const std::shared_ptr<Communicator>& group, uint64_t seed) {
    tensor_parallel::ColumnParallelLinearOptions c;
    c.seed = seed;
    tensor_parallel::RowParallelLinearOptions r;
    r.seed = seed + 1;
    const auto tp = DeviceMesh::from_group(group, "tp");
    col = register_module("col", tensor_parallel::ColumnParallelLinear(tp, kWidth, kHidden, c));
    row = register_module("row", tensor_parallel::RowParallelLinear(tp, kHidden, kWidth, r));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + row(torch::tanh(col(x))); }
};
TORCH_MODULE(TpBlock);

// Two blocks and a replicated head ("2.weight", "2.bias"); `dp` given: each
// block a unit over it.
inline torch::nn::Sequential make_tp_model(const std::shared_ptr<Communicator>& tp_group,
                                           const std::shared_ptr<Communicator>& dp,
                                           FullyShardOptions options) {
  auto unit = [&](torch::nn::AnyModule m) {
    return dp ? torch::nn::AnyModule(FullyShard(m, dp, options)) : m;
  };
  torch::nn::Sequential seq;
  seq->push_back(unit(torch::nn::AnyModule(TpBlock(tp_group, 11))));
  seq->push_back(unit(torch::nn::AnyModule(TpBlock(tp_group, 21))));
  auto head = torch::nn::Linear(kWidth, kWidth);
  fsdp_test::init_parameters(*head, 5);
  seq->push_back(head);
  return seq;
}

inline bool ends_with(const std::string& name, const std::string& s) {
  return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
}

// Whether the parameter `name` is whole on every TP rank (row.bias, the head).
inline bool replicated_over_tp(const std::string& name) {
  return !ends_with(name, "col.weight") && !ends_with(name, "col.bias") &&
         !ends_with(name, "row.weight");
}

// The slice of the one-process tensor `name` that TP rank `t` of `tp_size` holds.
inline torch::Tensor tp_slice(const std::string& name, const torch::Tensor& full, int t,
                              int tp_size) {
  if (ends_with(name, "col.weight") || ends_with(name, "col.bias")) {
    return full.chunk(tp_size, 0)[t];
  }
  if (ends_with(name, "row.weight")) return full.chunk(tp_size, 1)[t];
  return full;
}

}  // namespace cohort::testing::fsdp_tp
