// cohort-trace: the timelines a traced job wrote (COHORT_TRACE=DIR, or
// cohortrun --trace DIR).
//   cohort-trace merge DIR     DIR/rank-*.json -> DIR/trace.json (one lane per rank)
//   cohort-trace summary DIR   per rank: busy, communication, idle, slowest operations
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "trace_files.h"
#include "trace_summary.h"

namespace {

// The rank files merged in memory; a trace.json alone (copied from a job)
// is read as it is.
nlohmann::json load_merged(const std::string& dir) {
  const auto ranks = cohort_trace::read_rank_traces(dir);
  if (!ranks.empty()) return cohort_trace::merge_traces(ranks);
  const auto path = (std::filesystem::path(dir) / "trace.json").string();
  std::ifstream in(path);
  if (!in) throw cohort_trace::TraceError("cohort-trace: no rank-*.json nor trace.json in " + dir);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw cohort_trace::TraceError("cohort-trace: " + path + " is not JSON: " + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Merges and summarizes the per-rank timelines of a traced cohort job."};
  app.require_subcommand(1);
  std::string dir;
  size_t top = 5;
  auto* merge = app.add_subcommand("merge", "write DIR/trace.json, one process lane per rank");
  merge->add_option("dir", dir, "the trace folder (COHORT_TRACE)")->required();
  auto* summary =
      app.add_subcommand("summary", "per rank: busy, communication, idle, slowest operations");
  summary->add_option("dir", dir, "the trace folder (COHORT_TRACE)")->required();
  summary->add_option("--top", top, "slowest operations to list per rank (default 5)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (merge->parsed()) {
      const auto m = cohort_trace::merge_trace_dir(dir);
      if (m.ranks == 0) throw cohort_trace::TraceError("cohort-trace: no rank-*.json in " + dir);
      std::printf("cohort-trace: %d rank(s) -> %s/trace.json%s\n", m.ranks, dir.c_str(),
                  cohort_trace::describe_missing(m.missing).c_str());
      return 0;
    }
    const auto merged = load_merged(dir);
    std::fputs(cohort_trace::format_summary(cohort_trace::summarize_trace(merged, top)).c_str(),
               stdout);
    const auto missing = cohort_trace::missing_ranks(merged);
    if (!missing.empty()) {
      std::printf("\nmissing ranks:%s\n", cohort_trace::describe_missing(missing).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
