// defines: group_options and set_group_option: the hyperparameters of a
// LibTorch optimizer's parameter group (lr, betas, eps, weight decay, ...)
// as named numbers, the form a checkpoint keeps them in
// ("optim.param_groups.<param fqn>.<name>", as PyTorch's flattened
// distributed checkpoint names them).
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace cohort::dcp::detail {

/// The group's options by name, booleans as 0 or 1: every option of Adam,
/// AdamW, SGD, RMSprop and Adagrad; of another optimizer class its lr
/// (none when the class does not override get_lr).
std::vector<std::pair<std::string, double>> group_options(
    const torch::optim::OptimizerOptions& options);

/// Sets the option `name` (one group_options() names for this class).
void set_group_option(torch::optim::OptimizerOptions& options, const std::string& name,
                      double value);

/// Each parameter's group in `optimizer`, by the parameter's TensorImpl.
std::map<const void*, torch::optim::OptimizerParamGroup*> groups_by_param(
    torch::optim::Optimizer& optimizer);

}  // namespace cohort::dcp::detail
