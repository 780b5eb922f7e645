// defines: the rank-dependent inputs of the contract suite and their expected
// results as closed formulas, so no test needs a reference run.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort::testing {

// The device the contract's tensors live on: the CPU, or a CUDA device
// for the GPU check (the engines then carry them through host memory, or
// NCCL directly). Per thread, since ranks may be threads.
inline torch::Device& contract_device() {
  thread_local torch::Device device(torch::kCPU);
  return device;
}
inline torch::TensorOptions on(torch::Dtype dt = torch::kFloat32) {
  return torch::TensorOptions().dtype(dt).device(contract_device());
}

// Element counts every collective is tried with: empty, one, odd, ~1M.
inline const std::vector<int64_t> kCounts = {0, 1, 7, (1 << 20) + 3};

inline const std::vector<torch::Dtype> kDtypes = {
    torch::kFloat32, torch::kFloat64, torch::kFloat16, torch::kBFloat16,
    torch::kInt32,   torch::kInt64,   torch::kUInt8};

// Input of rank r at element i: (r+1) * (1 + i%3). Small integers, exact in
// every dtype, and sums for world <= 4 fit in uint8.
inline torch::Tensor rank_input(int r, int64_t n, torch::Dtype dt) {
  auto i = torch::arange(n, torch::kInt64);
  return ((i.remainder(3) + 1) * (r + 1)).to(on(dt));
}

// For prod: 1 + (r+i)%2, so products stay <= 2^world.
inline torch::Tensor prod_input(int r, int64_t n, torch::Dtype dt) {
  auto i = torch::arange(n, torch::kInt64);
  return ((i + r).remainder(2) + 1).to(on(dt));
}

inline torch::Tensor input_for(ReduceOp op, int r, int64_t n, torch::Dtype dt) {
  return op == ReduceOp::Prod ? prod_input(r, n, dt) : rank_input(r, n, dt);
}

// The reduction of input_for(op, r, n) over ranks 0..world-1, in float64.
inline torch::Tensor expected_reduction(ReduceOp op, int world, int64_t n) {
  auto i = torch::arange(n, torch::kFloat64);
  auto c = i.remainder(3) + 1;
  switch (op) {
    case ReduceOp::Sum:
      return c * (world * (world + 1) / 2.0);
    case ReduceOp::Avg:
      return c * ((world + 1) / 2.0);
    case ReduceOp::Min:
      return c;
    case ReduceOp::Max:
      return c * world;
    case ReduceOp::Prod: {
      // Ranks r with (r+i) odd contribute 2: ceil or floor of world/2.
      auto odd_i = i.remainder(2);
      const double even_ranks = (world + 1) / 2, odd_ranks = world / 2;
      return torch::pow(2.0, odd_i * even_ranks + (1 - odd_i) * odd_ranks);
    }
  }
  return {};
}

inline std::vector<ReduceOp> ops_for(torch::Dtype dt) {
  if (torch::isFloatingType(dt)) {
    return {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod};
  }
  return {ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod};
}

// Exact for integers; for avg in low precision, one rounding step apart.
inline bool matches(const torch::Tensor& got, const torch::Tensor& expected_f64) {
  auto expected = expected_f64.to(got.scalar_type()).to(torch::kFloat64);
  const double tol = got.scalar_type() == torch::kBFloat16  ? 1e-2
                     : got.scalar_type() == torch::kFloat16 ? 1e-3
                                                            : 0.0;
  return torch::allclose(got.cpu().to(torch::kFloat64), expected, tol, tol);
}

inline std::string dtype_label(torch::Dtype dt) { return std::string(c10::toString(dt)); }

}  // namespace cohort::testing
