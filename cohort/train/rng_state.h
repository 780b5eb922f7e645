// defines: cpu_rng_state / set_cpu_rng_state, the state of LibTorch's
// default CPU generator (dropout, randn, ...) as a uint8 tensor, so that a
// resumed run draws the same numbers as an uninterrupted one.
#pragma once

#include <torch/types.h>

namespace cohort {

torch::Tensor cpu_rng_state();
void set_cpu_rng_state(const torch::Tensor& state);

}  // namespace cohort
