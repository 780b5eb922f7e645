// defines: group_options and set_group_option: the hyperparameters of a
// LibTorch optimizer's parameter group (lr, betas, eps, weight decay, ...)
// as named numbers, the form a checkpoint keeps them in
// ("optim.param_groups.<param fqn>.<name>", as PyTorch's flattened
// distributed checkpoint names them).
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cohort/dcp/metadata.h"

namespace cohort::dcp::detail {

/// The group's options by name, booleans as 0 or 1: every option of Adam,
/// AdamW, SGD, RMSprop and Adagrad; of another optimizer class its lr
/// (none when the class does not override get_lr).
std::vector<std::pair<std::string, double>> group_options(
    const torch::optim::OptimizerOptions& options);

/// Sets the option `name` (one group_options() names for this class).
void set_group_option(torch::optim::OptimizerOptions& options, const std::string& name,
                      double value);

/// Throws ConfigError naming the option and `fqn` when `meta` holds an
/// option of parameter `fqn` ("optim.param_groups.<fqn>.<name>") that
/// another known optimizer class has and `options`' class has not: the
/// checkpoint was saved by another class, whose options of the same names
/// (lr, weight_decay) mean other things and whose state this one lacks.
void check_same_class(const torch::optim::OptimizerOptions& options, const Metadata& meta,
                      const std::string& fqn);

/// The targets one parameter group's options load from: per option, each
/// parameter's (its name, the 0-d tensor a load fills), in order.
using GroupTargets = std::map<std::string, std::vector<std::pair<std::string, torch::Tensor>>>;

/// Throws ConfigError naming the option, two parameters and their values
/// when the values that `value` gives the targets of one option differ: a
/// group has one value of each option, and taking one parameter's would
/// train the others with options they were never saved with. `what` names
/// the group ("the fused optimizer's one group").
void check_one_value(const GroupTargets& targets,
                     const std::function<torch::Tensor(const torch::Tensor&)>& value,
                     const std::string& what);

/// Each parameter's group in `optimizer`, by the parameter's TensorImpl.
std::map<const void*, torch::optim::OptimizerParamGroup*> groups_by_param(
    torch::optim::Optimizer& optimizer);

}  // namespace cohort::dcp::detail
