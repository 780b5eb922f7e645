// defines: StageCosts, SimulatorCosts, SimulationResult, simulate_schedule:
// a schedule's step time and bubble from measured costs, without the model;
// StageCostSamples, MonteCarloResult, simulate_schedule_monte_carlo: the same
// with each action's cost drawn from measured durations. simulate_schedule
// also reports each rank's peak activation memory (schedule_memory.h).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "cohort/pipeline/schedule.h"
#include "cohort/pipeline/schedule_memory.h"

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
  /// Per logical stage (a single entry: every stage): the memory model's
  /// activation and workspace bytes (with boundary_bytes for the buffers).
  std::vector<StageMemory> memory{StageMemory{}};
  /// The runtime's PipelineOptions::recv_window.
  int recv_window = 4;
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
  /// Per rank: the most micro-batches' activations held at once.
  std::vector<int> peak_live_microbatches;
  /// Per rank: the most bytes held at once (SimulatorCosts::memory).
  std::vector<int64_t> peak_activation_bytes;
};

/// Runs the schedule on a model of the ranks: compute actions take their
/// cost, a send makes its message available transfer_ms later, a receive
/// waits for it. Validates first (ScheduleError). Compute-only schedules
/// get their communication from add_communication.
SimulationResult simulate_schedule(const PipelineSchedule& schedule, const SimulatorCosts& costs);

/// Measured durations of one logical stage's compute actions, per type, in
/// milliseconds: the empirical distribution a Monte Carlo run draws from.
struct StageCostSamples {
  std::vector<double> forward_ms;          ///< F
  std::vector<double> backward_ms;         ///< B
  std::vector<double> backward_input_ms;   ///< I
  std::vector<double> backward_weight_ms;  ///< W
};

/// The distribution of simulated step times over many draws.
struct MonteCarloResult {
  double mean_step_ms = 0;          ///< the expected step time
  double mean_bubble_fraction = 0;  ///< the mean of SimulationResult::bubble_fraction
  double p10_step_ms = 0;           ///< 10th percentile of the step time
  double p90_step_ms = 0;           ///< 90th percentile of the step time
  int draws = 0;                    ///< simulated steps
};

/// Simulates `draws` steps, each compute action's cost drawn independently
/// and uniformly from its stage's samples of that type (a type with no
/// samples costs its mean from `costs`). In a pipeline one rank's slow
/// action is the other ranks' idle, so the expected step time exceeds the
/// step time of the mean costs whenever actions vary; zero variance gives
/// simulate_schedule exactly. `samples` has one entry per logical stage, or
/// a single entry for every stage. Deterministic for a given `seed`.
MonteCarloResult simulate_schedule_monte_carlo(const PipelineSchedule& schedule,
                                               const SimulatorCosts& costs,
                                               const std::vector<StageCostSamples>& samples,
                                               int draws, uint64_t seed = 1);

}  // namespace cohort::pipeline
