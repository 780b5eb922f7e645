#include "cohort/pipeline/schedule_simulator.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "cohort/pipeline/schedule_validator.h"

namespace cohort::pipeline {
namespace {

template <typename T>
const T& per(const std::vector<T>& v, int i) {
  return v.size() == 1 ? v[0] : v.at(i);
}

bool has_communication(const PipelineSchedule& s) {
  for (const auto& list : s.actions)
    for (const auto& a : list)
      if (!is_compute(a.type)) return true;
  return false;
}

double compute_cost(const Action& a, const SimulatorCosts& c) {
  const StageCosts& sc = per(c.stages, a.stage);
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

}  // namespace

SimulationResult simulate_schedule(const PipelineSchedule& input, const SimulatorCosts& costs) {
  validate_schedule(input);
  const PipelineSchedule s = has_communication(input) ? input : add_communication(input);
  if (costs.stages.empty() || costs.boundary_bytes.empty())
    throw InvalidArgument(
        "simulate_schedule: costs need at least one stage and one boundary entry");
  auto transfer = [&](int boundary) {
    int64_t bytes = per(costs.boundary_bytes, boundary);
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
          double c = compute_cost(a, costs);
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

}  // namespace cohort::pipeline
