#include "trace_files.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

namespace cohort_trace {
namespace fs = std::filesystem;

std::vector<RankTrace> read_rank_traces(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw TraceError("cohort-trace: " + dir + " is not a folder");
  static const std::regex name(R"(rank-(\d+)\.json)");
  std::vector<RankTrace> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (!std::regex_match(file, m, name)) continue;
    std::ifstream in(entry.path());
    nlohmann::json doc;
    try {
      doc = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw TraceError("cohort-trace: " + entry.path().string() + " is not JSON: " + e.what());
    }
    if (!doc.contains("traceEvents") || !doc["traceEvents"].is_array()) {
      throw TraceError("cohort-trace: " + entry.path().string() + " has no traceEvents array");
    }
    RankTrace r;
    r.rank = std::stoi(m[1].str());
    const auto& other = doc.value("otherData", nlohmann::json::object());
    r.clock_offset_us = other.value("clock_offset_us", 0.0);
    r.events = std::move(doc["traceEvents"]);
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end(),
            [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
  return out;
}

nlohmann::json merge_traces(const std::vector<RankTrace>& ranks) {
  auto events = nlohmann::json::array();
  auto lanes = nlohmann::json::array();
  for (const auto& r : ranks) {
    lanes.push_back(r.rank);
    for (auto e : r.events) {
      e["pid"] = r.rank;
      if (e.contains("ts")) e["ts"] = e["ts"].get<double>() + r.clock_offset_us;
      events.push_back(std::move(e));
    }
  }
  return {{"traceEvents", std::move(events)},
          {"displayTimeUnit", "ms"},
          {"otherData", {{"cohort_trace", 1}, {"ranks", std::move(lanes)}}}};
}

int merge_trace_dir(const std::string& dir) {
  const auto ranks = read_rank_traces(dir);
  if (ranks.empty()) return 0;
  const auto path = (fs::path(dir) / "trace.json").string();
  std::ofstream out(path, std::ios::trunc);
  out << merge_traces(ranks).dump() << '\n';
  out.flush();
  if (!out) throw TraceError("cohort-trace: cannot write " + path);
  return static_cast<int>(ranks.size());
}

}  // namespace cohort_trace
