// defines: the record of each optimizer parameter group's initial learning
// rate (what the Trainer's schedule scales) that a checkpoint keeps for
// every rank, keyed by the group's parameters' checkpoint names, and its
// match against the groups of the job that resumes.
//
// Ranks may hold different groups at different rates (a pipeline's stages
// with per-stage optimizers), and a resumed job may list its groups in
// another order or hold its parameters on other ranks (another world size,
// another pp): a group takes the rate recorded for its parameters by any
// rank that held them, never by its index.
#pragma once

#include <string>
#include <vector>

#include "cohort/dcp/dcp.h"
#include "cohort/plan/trainer_optimizer.h"

namespace cohort {

/// For each of `optimizer`'s groups, the names under which `state` (this
/// rank's checkpoint view of the same optimizer, TrainingPlan::dcp_state_dict)
/// holds its parameters, sorted: read from the group options the state
/// dict keeps per parameter ("optim.param_groups.<name>.lr"), with each
/// group's rate set for a moment to a mark of its own (restored before it
/// returns, also on a throw). A group none of whose parameters the state
/// dict holds has no names.
std::vector<std::vector<std::string>> group_parameter_names(TrainerOptimizer& optimizer,
                                                            dcp::StateDict& state);

/// This rank's record: one line per group with names, its rate (exact) and
/// its names.
std::string encode_initial_lrs(const std::vector<std::vector<std::string>>& names,
                               const std::vector<double>& lrs);

/// The initial rate of each of this rank's groups (`names`, as
/// group_parameter_names gives them) from `records` (every rank's record of
/// the job that wrote the checkpoint): the rate recorded for its
/// parameters. A group without names keeps its rate in `mine`. Throws
/// ConfigError (beginning with `where`) when a group's parameters were not
/// recorded or were recorded at different rates.
std::vector<double> match_initial_lrs(const std::vector<std::string>& records,
                                      const std::vector<std::vector<std::string>>& names,
                                      const std::vector<double>& mine, const std::string& where);

}  // namespace cohort
