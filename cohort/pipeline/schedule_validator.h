// defines: validate_schedule (the checks and the dry run a
// schedule passes before anything runs; ScheduleError is in core/error.h),
// format_grid.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/pipeline/schedule.h"

namespace cohort::pipeline {

/// cohort::ScheduleError (core/error.h), under the pipeline's namespace too.
using ScheduleError = cohort::ScheduleError;

/// The step-by-rank grid: one row per step, one column per rank; cells in
/// `marks` ((rank, step) pairs; step == list size marks the end) get `<<`.
std::string format_grid(const PipelineSchedule& schedule,
                        const std::vector<std::pair<int, int>>& marks = {});

/// Refuses (ScheduleError) a schedule that breaks any rule below, naming the
/// first broken rule:
///  - shape: ranks, stages, micro-batches positive; every stage on one rank
///    in range; every rank holds a stage; actions only for its own stages;
///  - per stage and micro-batch: exactly one F, then either one B or one I
///    followed by one W; F of stage s after stage s-1's F and B/I of stage s
///    after stage s+1's B/I (locally, or through a receive);
///  - every boundary between ranks has its SEND/RECV pair, each once, a
///    send after the action that produces the tensor;
///  - a dry run over all ranks (sends never block, a receive blocks until
///    its send ran) finishes: otherwise the blocked steps are marked.
/// A schedule with no communication actions at all is checked as
/// add_communication would complete it.
void validate_schedule(const PipelineSchedule& schedule);

}  // namespace cohort::pipeline
