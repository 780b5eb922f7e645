#include "trace_summary.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

namespace cohort_trace {
namespace {

using Spans = std::vector<std::pair<double, double>>;  // [start, end) in us

// Length of the union of the spans.
double union_us(Spans s) {
  std::sort(s.begin(), s.end());
  double total = 0, start = 0, end = 0;
  bool open = false;
  for (auto [a, b] : s) {
    if (open && a <= end) {
      end = std::max(end, b);
      continue;
    }
    if (open) total += end - start;
    start = a;
    end = b;
    open = true;
  }
  if (open) total += end - start;
  return total;
}

struct Lane {
  Spans all, comm, flight;
  double first = 1e300, last = -1e300;
  int64_t operations = 0, pipeline_actions = 0, dropped = 0;
  double pipeline_compute_us = 0, pipeline_blocked_us = 0;
  std::vector<SlowOp> ops;
  std::map<uint64_t, std::pair<double, size_t>> begins;  // open flights: id -> (ts, op)
};

}  // namespace

std::vector<RankSummary> summarize_trace(const nlohmann::json& merged, size_t top) {
  std::map<int, Lane> lanes;
  for (const auto& e : merged.at("traceEvents")) {
    const std::string ph = e.value("ph", "");
    if (ph == "M" || !e.contains("ts")) continue;
    auto& lane = lanes[e.value("pid", 0)];
    const double ts = e["ts"].get<double>();
    const std::string cat = e.value("cat", "");
    if (ph == "X") {
      const double end = ts + e.value("dur", 0.0);
      lane.all.emplace_back(ts, end);
      if (cat == "comm" || cat == "comm.wait" || cat == "pipeline.comm")
        lane.comm.emplace_back(ts, end);
      if (cat == "comm") ++lane.operations;
      if (cat == "pipeline.compute" || cat == "pipeline.comm") ++lane.pipeline_actions;
      if (cat == "pipeline.compute") lane.pipeline_compute_us += end - ts;
      if (cat == "pipeline.comm" && e.contains("args"))
        lane.pipeline_blocked_us += e["args"].value("blocked_us", 0.0);
      lane.first = std::min(lane.first, ts);
      lane.last = std::max(lane.last, end);
    } else if (ph == "i" && cat == "trace" && e.value("name", "") == "dropped events") {
      lane.dropped += e.value("args", nlohmann::json::object()).value("dropped", int64_t{0});
    } else if (ph == "b" && cat == "comm.flight") {
      const auto& args = e.value("args", nlohmann::json::object());
      SlowOp op;
      op.name = e.value("name", "");
      op.group = args.value("group", "");
      op.seq = static_cast<int64_t>(args.value("seq", 0.0));
      op.bytes = static_cast<int64_t>(args.value("bytes", 0.0));
      op.seconds = -1;  // until the matching "e"
      lane.begins[e.value("id", uint64_t{0})] = {ts, lane.ops.size()};
      lane.ops.push_back(std::move(op));
    } else if (ph == "e" && cat == "comm.flight") {
      auto it = lane.begins.find(e.value("id", uint64_t{0}));
      if (it == lane.begins.end()) continue;
      const auto [start, index] = it->second;
      lane.flight.emplace_back(start, ts);
      lane.ops[index].seconds = (ts - start) / 1e6;
      lane.begins.erase(it);
    }
  }
  std::vector<RankSummary> out;
  for (auto& [rank, lane] : lanes) {
    RankSummary s;
    s.rank = rank;
    if (lane.last > lane.first) s.wall_s = (lane.last - lane.first) / 1e6;
    const double active = union_us(lane.all) / 1e6;
    s.comm_s = union_us(lane.comm) / 1e6;
    s.busy_s = std::max(0.0, active - s.comm_s);
    s.idle_s = std::max(0.0, s.wall_s - active);
    s.in_flight_s = union_us(lane.flight) / 1e6;
    s.operations = lane.operations;
    s.pipeline_actions = lane.pipeline_actions;
    s.pipeline_compute_s = lane.pipeline_compute_us / 1e6;
    s.pipeline_blocked_s = lane.pipeline_blocked_us / 1e6;
    s.dropped_events = lane.dropped;
    auto& ops = lane.ops;
    ops.erase(std::remove_if(ops.begin(), ops.end(), [](const SlowOp& o) { return o.seconds < 0; }),
              ops.end());
    std::sort(ops.begin(), ops.end(),
              [](const SlowOp& a, const SlowOp& b) { return a.seconds > b.seconds; });
    if (ops.size() > top) ops.resize(top);
    s.slowest = std::move(ops);
    out.push_back(std::move(s));
  }
  return out;
}

std::string format_summary(const std::vector<RankSummary>& ranks) {
  std::string out;
  char line[256];
  auto pct = [](double part, double whole) { return whole > 0 ? 100 * part / whole : 0.0; };
  std::snprintf(line, sizeof line, "%-5s %10s %16s %16s %16s %12s %6s\n", "rank", "wall s",
                "busy s (%)", "comm s (%)", "idle s (%)", "in flight s", "ops");
  out += line;
  for (const auto& r : ranks) {
    std::snprintf(line, sizeof line,
                  "%-5d %10.3f %9.3f (%3.0f%%) %9.3f (%3.0f%%) %9.3f (%3.0f%%) %12.3f %6lld\n",
                  r.rank, r.wall_s, r.busy_s, pct(r.busy_s, r.wall_s), r.comm_s,
                  pct(r.comm_s, r.wall_s), r.idle_s, pct(r.idle_s, r.wall_s), r.in_flight_s,
                  static_cast<long long>(r.operations));
    out += line;
  }
  bool pipeline = false;
  for (const auto& r : ranks) pipeline = pipeline || r.pipeline_actions > 0;
  if (pipeline) {
    std::snprintf(line, sizeof line, "\npipeline: %-5s %8s %16s %22s\n", "rank", "actions",
                  "compute s (%)", "blocked in recv s (%)");
    out += line;
    for (const auto& r : ranks) {
      std::snprintf(line, sizeof line, "          %-5d %8lld %9.3f (%3.0f%%) %15.3f (%3.0f%%)\n",
                    r.rank, static_cast<long long>(r.pipeline_actions), r.pipeline_compute_s,
                    pct(r.pipeline_compute_s, r.wall_s), r.pipeline_blocked_s,
                    pct(r.pipeline_blocked_s, r.wall_s));
      out += line;
    }
  }
  for (const auto& r : ranks) {
    if (r.dropped_events == 0) continue;
    std::snprintf(line, sizeof line,
                  "\nrank %d: %lld events dropped (COHORT_TRACE_MAX_EVENTS reached); the figures "
                  "cover the events kept\n",
                  r.rank, static_cast<long long>(r.dropped_events));
    out += line;
  }
  for (const auto& r : ranks) {
    if (r.slowest.empty()) continue;
    std::snprintf(line, sizeof line, "\nrank %d, slowest operations (time in flight):\n", r.rank);
    out += line;
    for (const auto& op : r.slowest) {
      std::snprintf(line, sizeof line, "  %10.3f ms  %-24s group %-12s seq %-6lld %lld bytes\n",
                    op.seconds * 1e3, op.name.c_str(), op.group.c_str(),
                    static_cast<long long>(op.seq), static_cast<long long>(op.bytes));
      out += line;
    }
  }
  return out;
}

}  // namespace cohort_trace
