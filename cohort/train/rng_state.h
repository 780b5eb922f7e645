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

/// The state of the default generator of `device` (a CUDA device's:
/// dropout on the GPU draws from it), as a CPU uint8 tensor, and its
/// restore. Through at::Context, so that a build without CUDA compiles the
/// same code.
torch::Tensor device_rng_state(const torch::Device& device);
void set_device_rng_state(const torch::Device& device, const torch::Tensor& state);
/// Seeds the default generator of `device`.
void seed_device_rng(const torch::Device& device, uint64_t seed);

}  // namespace cohort
