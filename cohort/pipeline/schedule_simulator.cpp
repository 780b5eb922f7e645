#include "cohort/pipeline/schedule_simulator.h"

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include "cohort/pipeline/schedule_validator.h"

namespace cohort::pipeline {
namespace {

double compute_cost(const Action& a, const SimulatorCosts& c) {
  const StageCosts& sc = per_stage(c.stages, a.stage);
  switch (a.type) {
    case ActionType::Forward:
      return sc.forward_ms;
    case ActionType::Backward:
      return sc.backward_ms;
    case ActionType::BackwardInput:
      return sc.backward_input_ms;
    case ActionType::BackwardWeight:
      return sc.backward_weight_ms;
    default:
      return 0;
  }
}

using CostFn = std::function<double(const Action&)>;

// The simulation proper, on a validated schedule with communication.
SimulationResult run(const PipelineSchedule& s, const SimulatorCosts& costs, const CostFn& cost);

PipelineSchedule checked(const PipelineSchedule& input, const SimulatorCosts& costs,
                         const char* who) {
  validate_schedule(input);
  if (costs.stages.empty() || costs.boundary_bytes.empty())
    throw InvalidArgument(std::string(who) +
                          ": costs need at least one stage and one boundary entry");
  return has_communication(input) ? input : add_communication(input);
}

const std::vector<double>& samples_of(const StageCostSamples& s, ActionType t) {
  switch (t) {
    case ActionType::Forward:
      return s.forward_ms;
    case ActionType::Backward:
      return s.backward_ms;
    case ActionType::BackwardInput:
      return s.backward_input_ms;
    default:
      return s.backward_weight_ms;
  }
}

}  // namespace

SimulationResult simulate_schedule(const PipelineSchedule& input, const SimulatorCosts& costs) {
  const PipelineSchedule s = checked(input, costs, "simulate_schedule");
  SimulationResult out = run(s, costs, [&](const Action& a) { return compute_cost(a, costs); });
  const ScheduleMemory memory =
      schedule_memory(s, MemoryCosts{costs.memory, costs.boundary_bytes, costs.recv_window});
  out.peak_live_microbatches = memory.peak_live_microbatches;
  out.peak_activation_bytes = memory.peak_bytes;
  return out;
}

MonteCarloResult simulate_schedule_monte_carlo(const PipelineSchedule& input,
                                               const SimulatorCosts& costs,
                                               const std::vector<StageCostSamples>& samples,
                                               int draws, uint64_t seed) {
  const PipelineSchedule s = checked(input, costs, "simulate_schedule_monte_carlo");
  if (draws <= 0) throw InvalidArgument("simulate_schedule_monte_carlo: draws must be positive");
  if (samples.empty() || (samples.size() != 1 && samples.size() != size_t(s.num_stages)))
    throw InvalidArgument("simulate_schedule_monte_carlo: " + std::to_string(samples.size()) +
                          " sample sets for " + std::to_string(s.num_stages) +
                          " stages (one per stage, or one for all)");
  std::mt19937_64 rng(seed);
  auto cost = [&](const Action& a) {
    const std::vector<double>& v = samples_of(per_stage(samples, a.stage), a.type);
    if (v.empty()) return compute_cost(a, costs);
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  MonteCarloResult out;
  out.draws = draws;
  std::vector<double> steps;
  for (int d = 0; d < draws; ++d) {
    SimulationResult r = run(s, costs, cost);
    steps.push_back(r.step_ms);
    out.mean_step_ms += r.step_ms / draws;
    out.mean_bubble_fraction += r.bubble_fraction / draws;
  }
  std::sort(steps.begin(), steps.end());
  out.p10_step_ms = steps[size_t(0.1 * (draws - 1))];
  out.p90_step_ms = steps[size_t(0.9 * (draws - 1))];
  return out;
}

namespace {

SimulationResult run(const PipelineSchedule& s, const SimulatorCosts& costs, const CostFn& cost) {
  auto transfer = [&](int boundary) {
    int64_t bytes = per_stage(costs.boundary_bytes, boundary);
    return costs.transfer_ms ? costs.transfer_ms(bytes) : 0.0;
  };
  SimulationResult out;
  out.compute_ms.assign(s.num_ranks, 0);
  out.finish_ms.assign(s.num_ranks, 0);
  // (type of the send, stage, micro-batch) -> when the message is there.
  std::map<std::tuple<ActionType, int, int>, double> arrival;
  std::vector<size_t> pc(s.num_ranks, 0);
  bool progress = true;
  while (progress) {  // validated: this ends with every rank done
    progress = false;
    for (int r = 0; r < s.num_ranks; ++r) {
      double& clock = out.finish_ms[r];
      for (; pc[r] < s.actions[r].size(); ++pc[r], progress = true) {
        const Action& a = s.actions[r][pc[r]];
        if (is_compute(a.type)) {
          double c = cost(a);
          clock += c;
          out.compute_ms[r] += c;
        } else if (a.type == ActionType::SendForward) {
          clock += costs.p2p_overhead_ms;
          arrival[{a.type, a.stage, a.microbatch}] = clock + transfer(a.stage);
        } else if (a.type == ActionType::SendBackward) {
          clock += costs.p2p_overhead_ms;
          arrival[{a.type, a.stage, a.microbatch}] = clock + transfer(a.stage - 1);
        } else {
          const bool fwd = a.type == ActionType::RecvForward;
          auto it = arrival.find({fwd ? ActionType::SendForward : ActionType::SendBackward,
                                  fwd ? a.stage - 1 : a.stage + 1, a.microbatch});
          if (it == arrival.end()) break;
          clock = std::max(clock, it->second) + costs.p2p_overhead_ms;
        }
      }
    }
  }
  out.step_ms = *std::max_element(out.finish_ms.begin(), out.finish_ms.end());
  double frac = 0, ratio = 0;
  for (int r = 0; r < s.num_ranks; ++r) {
    frac += out.step_ms > 0 ? 1 - out.compute_ms[r] / out.step_ms : 0;
    ratio += out.compute_ms[r] > 0 ? (out.step_ms - out.compute_ms[r]) / out.compute_ms[r] : 0;
  }
  out.bubble_fraction = frac / s.num_ranks;
  out.bubble_ratio = ratio / s.num_ranks;
  return out;
}

}  // namespace

}  // namespace cohort::pipeline
