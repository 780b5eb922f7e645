// defines: share_step_outcome: the end of a step on every rank of the
// pipeline group: the last stage's per-micro-batch losses, a loss that
// could not train, and any rank's refused send (internal to PipelineRuntime).
#pragma once

#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/pipeline/stage_executor.h"

namespace cohort::pipeline {

/// Collective over `group`: one all-gather of m + 3 words per rank (this
/// rank's `losses`, its first micro-batch whose loss could not train, and
/// whether it refused a send), then, only when some rank refused a send,
/// the refusals' texts (`refused_send`, "" for none). Returns the last
/// stage's losses on every rank, or throws InvalidArgument on every rank
/// naming each refused send (before a refused loss: a stand-in sent in a
/// refused tensor's place may have reached the loss).
std::vector<double> share_step_outcome(Communicator& group, const PipelineSchedule& schedule,
                                       const StepLosses& losses, const std::string& refused_send);

}  // namespace cohort::pipeline
