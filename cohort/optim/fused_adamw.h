// defines: adamw_update, one AdamW step on flat tensors, written operation
// for operation as LibTorch's torch::optim::AdamW::step (1.13 and 2.x):
//
//   p  *= 1 - lr * weight_decay                    (decoupled decay first)
//   m   = beta1 * m + (1 - beta1) * g
//   v   = beta2 * v + (1 - beta2) * g * g
//   v̂   = amsgrad ? (vmax = max(vmax, v)) : v
//   p  -= lr / (1 - beta1^t) * m / (sqrt(v̂) / sqrt(1 - beta2^t) + eps)
//
// Element-wise, so running it on a flat buffer of many parameters (one
// kernel per operation instead of one per parameter) gives the same numbers
// as running it per parameter, provided they share the step count t.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/types.h>

namespace cohort {

/// step is the count after this update (1 for the first). max_exp_avg_sq is
/// only read when options.amsgrad().
void adamw_update(torch::Tensor& param, const torch::Tensor& grad, torch::Tensor& exp_avg,
                  torch::Tensor& exp_avg_sq, torch::Tensor& max_exp_avg_sq, int64_t step,
                  const torch::optim::AdamWOptions& options);

}  // namespace cohort
