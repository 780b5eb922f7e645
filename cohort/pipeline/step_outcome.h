// defines: StepFailure, share_step_outcome: the end of a step on every rank
// of the pipeline group: the last stage's per-micro-batch losses, a loss
// that could not train, any rank's refused send and any stage's code that
// threw (internal to PipelineRuntime).
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/pipeline/stage_executor.h"

namespace cohort::pipeline {

/// What went wrong on this rank during the step ("" for nothing).
struct StepFailure {
  std::string refused_send;     ///< the channel's first refused send
  std::string stage_error;      ///< the executor's first exception from a stage's code
  std::exception_ptr original;  ///< that exception
};

/// Collective over `group`: one all-gather of m + 3 words per rank (this
/// rank's `losses`, its first micro-batch whose loss could not train, and
/// what failed: 0 nothing, 1 a refused send, 2 a stage's code), then, only
/// when some rank failed, the failures' texts. Returns the last stage's
/// losses on every rank, or throws on every rank naming each failure: a
/// StageError when some stage's code threw (on that rank with the original
/// nested), else an InvalidArgument for the refused sends (both before a
/// refused loss: a stand-in sent in a failed tensor's place may have reached
/// the loss).
std::vector<double> share_step_outcome(Communicator& group, const PipelineSchedule& schedule,
                                       const StepLosses& losses, const StepFailure& failure);

}  // namespace cohort::pipeline
