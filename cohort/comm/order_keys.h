// Floating min and max reduced as integer min and max, so that NaN wins.
//
// at::minimum and torch.max propagate NaN. c10d's Gloo, MPI and NCCL compare
// with `<` and keep or drop a NaN depending on which rank holds it. So the
// Communicator reduces a floating min or max as order-preserving integer
// keys where the engine compares with `<` (Engine::propagates_nan), which
// every engine and algorithm reduces exactly, in the same bytes and the same
// one collective:
// - a float's bits read as a signed integer order the non-negative floats;
//   flipping all bits but the sign of the negative ones orders those too,
//   below them (-0 just below +0, -inf below every finite value);
// - NaN becomes the largest key for max and the smallest for min;
// - decoding is the same flip, and the winning NaN key decodes to a NaN.
// Cost: one pass into a new buffer before, one pass back after; no extra
// message (docs/benchmarks.md, "Min and max with NaN").
#pragma once

#include <torch/types.h>

#include "cohort/core/engine.h"
#include "cohort/core/types.h"

namespace cohort::detail {

// Whether a reduction of this (reduction) dtype runs on order keys.
bool reduces_as_keys(const Engine& engine, at::ScalarType dtype, ReduceOp op);

// The dtype of the keys of f32 (int32) or f64 (int64) values.
inline at::ScalarType order_key_dtype(at::ScalarType values) {
  return values == at::kDouble ? at::kLong : at::kInt;
}

// The keys of f32 (int32) or f64 (int64) `values`, a new tensor.
torch::Tensor to_order_keys(const torch::Tensor& values, ReduceOp op);

// The f32 or f64 values of reduced `keys`, a new tensor.
torch::Tensor order_keys_to_values(const torch::Tensor& keys);

// Writes the values of `keys` into `out` (any floating dtype, keys' shape).
void order_keys_into(const torch::Tensor& keys, torch::Tensor& out);

// Whether `buf` holds the order keys of the floating `out`.
inline bool holds_order_keys(const torch::Tensor& out, const torch::Tensor& buf) {
  return at::isFloatingType(out.scalar_type()) && !at::isFloatingType(buf.scalar_type());
}

}  // namespace cohort::detail
