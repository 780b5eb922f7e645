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
  int world_size = 0;  // otherData.world_size (0: not said)
  double clock_offset_us = 0;
  nlohmann::json events;  // the file's "traceEvents"
};

// Every DIR/rank-<r>.json, ordered by rank; empty if there is none. Throws
// TraceError for files of different world sizes, or a rank outside its
// world: files of two runs in one folder, which must not be mixed.
std::vector<RankTrace> read_rank_traces(const std::string& dir);

// One trace: each rank's events in lane (pid) r, timestamps moved to rank
// 0's clock. otherData holds the ranks merged ("ranks"), the world size and
// the ranks of that world without a file ("missing_ranks": a rank that died
// before writing one).
nlohmann::json merge_traces(const std::vector<RankTrace>& ranks);

// The ranks of `merged`'s world that have no lane (its otherData).
std::vector<int> missing_ranks(const nlohmann::json& merged);

// What merge_trace_dir merged.
struct MergedDir {
  int ranks = 0;             // rank files merged (0: nothing written)
  std::vector<int> missing;  // ranks of the world without a file
};

// Merges DIR's rank files into DIR/trace.json (written aside and renamed
// onto it: a reader, or a second merge at once, never sees half a file).
MergedDir merge_trace_dir(const std::string& dir);

// "" when none is missing, else " (no file from rank 1, 3: ...)".
std::string describe_missing(const std::vector<int>& missing);

}  // namespace cohort_trace
