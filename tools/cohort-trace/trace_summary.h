// defines: RankSummary, summarize_trace, format_summary: where each rank's
// time went in a merged trace (busy, communicating, idle) and its slowest
// collectives.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace cohort_trace {

// One collective's time in flight.
struct SlowOp {
  std::string name;   // "all_reduce", ...
  std::string group;  // the communicator's name
  int64_t seq = 0;    // its place in the group's order (same on every rank)
  int64_t bytes = 0;  // payload
  double seconds = 0;
};

// Where one rank's time went, between its first and last traced event.
// comm is time inside issuing or waiting for an operation, or inside a
// pipeline send or receive action (communication the rank was held up by);
// busy is time inside other traced spans (forward, backward, optimizer,
// pipeline compute actions, ...); idle is time inside none.
struct RankSummary {
  int rank = 0;
  double wall_s = 0, busy_s = 0, comm_s = 0, idle_s = 0;
  double in_flight_s = 0;  // union of the collectives' time in flight
  int64_t operations = 0;  // operations issued
  std::vector<SlowOp> slowest;
  int64_t pipeline_actions = 0;   // pipeline schedule actions run (F, B, I, W, sends, receives)
  double pipeline_compute_s = 0;  // time in F, B, I and W
  double pipeline_blocked_s = 0;  // time receives waited for their message
  int64_t dropped_events = 0;     // events the rank's trace left out (its cap was reached)
};

// Per lane (pid) of a merged trace, the `top` slowest operations each.
std::vector<RankSummary> summarize_trace(const nlohmann::json& merged, size_t top = 5);

// A table for people.
std::string format_summary(const std::vector<RankSummary>& ranks);

}  // namespace cohort_trace
