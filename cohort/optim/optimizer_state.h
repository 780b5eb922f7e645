// defines: state_tensors, state_step, optimizer_state_bytes: a uniform view
// of the per-parameter state of LibTorch's optimizers (AdamW, Adam, SGD,
// RMSprop, Adagrad), whose state classes share no accessor interface.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cohort {

// The named tensors of one parameter's state (undefined ones left out).
// Throws Unsupported for a state class it does not know.
std::vector<std::pair<std::string, torch::Tensor>> state_tensors(
    const torch::optim::OptimizerParamState& state);
// The state's step count, for the optimizers that keep one.
std::optional<int64_t> state_step(const torch::optim::OptimizerParamState& state);
// The tensor state names the optimizer's state class can hold, in a fixed
// order (for collectives that must agree on them before any state exists).
std::vector<std::string> state_names(const torch::optim::Optimizer& optimizer);
// Bytes of all state tensors the optimizer holds.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace cohort
