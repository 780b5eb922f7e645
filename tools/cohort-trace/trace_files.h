// defines: TraceError, read_rank_traces, merge_traces, merge_trace_dir: the
// per-rank timeline files (rank-<r>.json, written by cohort::Tracer) read and
// merged into one Chrome trace with one process lane per rank.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace cohort_trace {

// A missing or malformed trace file; the message names it.
class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One rank's file as written: its events in its own clock, and the offset
// (microseconds) that takes its clock to rank 0's.
struct RankTrace {
  int rank = 0;
  double clock_offset_us = 0;
  nlohmann::json events;  // the file's "traceEvents"
};

// Every DIR/rank-<r>.json, ordered by rank; empty if there is none.
std::vector<RankTrace> read_rank_traces(const std::string& dir);

// One trace: each rank's events in lane (pid) r, timestamps moved to rank
// 0's clock.
nlohmann::json merge_traces(const std::vector<RankTrace>& ranks);

// Merges DIR's rank files into DIR/trace.json and returns the number of
// ranks merged (0: nothing written).
int merge_trace_dir(const std::string& dir);

}  // namespace cohort_trace
