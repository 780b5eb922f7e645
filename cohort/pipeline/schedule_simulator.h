// defines: StageCosts, SimulatorCosts, SimulationResult, simulate_schedule:
// a schedule's step time and bubble from measured costs, without the model.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "cohort/pipeline/schedule.h"

namespace cohort::pipeline {

/// Time of each compute action of one logical stage, in milliseconds.
struct StageCosts {
  /// F: a forward pass.
  double forward_ms = 1;
  double backward_ms = 2;         ///< full B
  double backward_input_ms = 1;   ///< I
  double backward_weight_ms = 1;  ///< W
};

/// What the simulator knows about a run.
struct SimulatorCosts {
  /// Per logical stage; a single entry applies to every stage.
  std::vector<StageCosts> stages{StageCosts{}};
  /// Bytes that cross each stage boundary (activations forward, the same
  /// amount of gradient back); a single entry applies to every boundary.
  std::vector<int64_t> boundary_bytes{0};
  /// Time for a point-to-point message of `bytes` (from a measurement, e.g.
  /// latency + bytes / bandwidth); unset: transfers are free.
  std::function<double(int64_t bytes)> transfer_ms;
  /// Time the sender spends posting a send and the receiver finishing a
  /// receive (host work, copies); charged to the rank, not overlapped.
  double p2p_overhead_ms = 0;
};

/// What a simulated step looks like.
struct SimulationResult {
  double step_ms = 0;  ///< until the last rank finishes
  /// 1 - (time in compute actions) / step_ms, averaged over ranks (what
  /// the benchmark measures). Equal costs, free transfers: GPipe and 1F1B
  /// give (p-1)/(m+p-1).
  double bubble_fraction = 0;
  /// Idle time over compute time, averaged over ranks: Megatron's bubble,
  /// (p-1)/(v*m) for GPipe, 1F1B and interleaved with equal costs.
  double bubble_ratio = 0;
  std::vector<double> compute_ms;  ///< per rank
  std::vector<double> finish_ms;   ///< per rank
};

/// Runs the schedule on a model of the ranks: compute actions take their
/// cost, a send makes its message available transfer_ms later, a receive
/// waits for it. Validates first (ScheduleError). Compute-only schedules
/// get their communication from add_communication.
SimulationResult simulate_schedule(const PipelineSchedule& schedule, const SimulatorCosts& costs);

}  // namespace cohort::pipeline
