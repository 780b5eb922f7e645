// defines: cpu_rng_state / set_cpu_rng_state, the state of LibTorch's
// default CPU generator (dropout, randn, ...) as a uint8 tensor, so that a
// resumed run draws the same numbers as an uninterrupted one.
#pragma once

#include <torch/types.h>

namespace cohort {

torch::Tensor cpu_rng_state();
void set_cpu_rng_state(const torch::Tensor& state);
/// The state of a fresh CPU generator seeded with `seed` (for a rank that a
/// checkpoint has no state of: a job resumed at a bigger world size).
torch::Tensor seeded_cpu_rng_state(uint64_t seed);

}  // namespace cohort
