// defines: broadcast_losses: one step's per-micro-batch losses from the last
// stage's rank to every rank of the pipeline group (internal to
// PipelineRuntime).
#pragma once

#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/pipeline/stage_executor.h"

namespace cohort::pipeline {

/// Collective over `group`, one broadcast from the last stage's rank
/// carrying its `losses` and the first micro-batch whose loss could not
/// train. Returns the losses on every rank, or throws InvalidArgument on
/// every rank naming that micro-batch, the last stage and its rank.
std::vector<double> broadcast_losses(Communicator& group, const PipelineSchedule& schedule,
                                     const StepLosses& losses);

}  // namespace cohort::pipeline
