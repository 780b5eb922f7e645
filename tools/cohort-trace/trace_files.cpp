#include "trace_files.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

namespace cohort_trace {
namespace fs = std::filesystem;

namespace {

std::string file_of(const std::string& dir, int rank) {
  return (fs::path(dir) / ("rank-" + std::to_string(rank) + ".json")).string();
}

// The files must be one run's: one world size, every rank inside it.
void check_one_world(const std::string& dir, const std::vector<RankTrace>& ranks) {
  const RankTrace* first = nullptr;
  for (const auto& r : ranks) {
    if (r.world_size == 0) continue;  // a file that does not say
    if (r.rank >= r.world_size || (first && r.world_size != first->world_size)) {
      const std::string other = first && r.world_size != first->world_size
                                    ? ", but " + file_of(dir, first->rank) + " is of a world of " +
                                          std::to_string(first->world_size)
                                    : "";
      throw TraceError("cohort-trace: " + file_of(dir, r.rank) + " is rank " +
                       std::to_string(r.rank) + " of " + std::to_string(r.world_size) + other +
                       ": files of different runs in one folder; remove the older ones");
    }
    if (!first) first = &r;
  }
}

}  // namespace

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
    r.world_size = other.value("world_size", 0);
    r.events = std::move(doc["traceEvents"]);
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end(),
            [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
  check_one_world(dir, out);
  return out;
}

nlohmann::json merge_traces(const std::vector<RankTrace>& ranks) {
  auto events = nlohmann::json::array();
  auto lanes = nlohmann::json::array();
  int world = 0;
  for (const auto& r : ranks) world = std::max(world, r.world_size);
  auto missing = nlohmann::json::array();
  for (int rank = 0; rank < world; ++rank) {
    const bool has =
        std::any_of(ranks.begin(), ranks.end(), [&](const RankTrace& r) { return r.rank == rank; });
    if (!has) missing.push_back(rank);
  }
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
          {"otherData",
           {{"cohort_trace", 1},
            {"ranks", std::move(lanes)},
            {"world_size", world},
            {"missing_ranks", std::move(missing)}}}};
}

std::vector<int> missing_ranks(const nlohmann::json& merged) {
  const auto other = merged.value("otherData", nlohmann::json::object());
  return other.value("missing_ranks", std::vector<int>{});
}

std::string describe_missing(const std::vector<int>& missing) {
  if (missing.empty()) return "";
  std::string list;
  for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
  return " (no file from rank " + list +
         ": killed before writing one, or on a node that writes elsewhere)";
}

MergedDir merge_trace_dir(const std::string& dir) {
  const auto ranks = read_rank_traces(dir);
  if (ranks.empty()) return {};
  const auto merged = merge_traces(ranks);
  const auto path = fs::path(dir) / "trace.json";
  // A name of this process's own beside it, renamed onto it.
  const auto aside = fs::path(dir) / (".trace.json." + std::to_string(::getpid()));
  {
    std::ofstream out(aside, std::ios::trunc);
    out << merged.dump() << '\n';
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(aside, ec);
      throw TraceError("cohort-trace: cannot write " + aside.string());
    }
  }
  std::error_code ec;
  fs::rename(aside, path, ec);
  if (ec) {
    fs::remove(aside, ec);
    throw TraceError("cohort-trace: cannot write " + path.string() + ": " + ec.message());
  }
  return {static_cast<int>(ranks.size()), missing_ranks(merged)};
}

}  // namespace cohort_trace
