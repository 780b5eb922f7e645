#include "cohort/algorithms/cost_model.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>

#include "cohort/core/error.h"

namespace cohort::algorithms {

PiecewiseCost::PiecewiseCost(std::vector<std::pair<double, double>> points)
    : points_(std::move(points)) {
  std::sort(points_.begin(), points_.end());
  for (size_t i = 1; i < points_.size(); ++i) {
    if (points_[i].first == points_[i - 1].first) {
      throw InvalidArgument("cohort: cost model: two measurements of " +
                            std::to_string(points_[i].first) + " bytes");
    }
  }
  // Isotonic fit (pool adjacent violators): a run of points that decreases
  // with size is replaced by its mean, repeatedly, until the times are
  // non-decreasing. Each pool is (sum of times, count); equal weights.
  std::vector<std::pair<double, int>> pools;
  for (auto& p : points_) {
    pools.emplace_back(p.second, 1);
    while (pools.size() > 1) {
      auto& last = pools.back();
      auto& prev = pools[pools.size() - 2];
      if (prev.first / prev.second <= last.first / last.second) break;
      prev.first += last.first;
      prev.second += last.second;
      pools.pop_back();
    }
  }
  size_t i = 0;
  for (auto& [sum, count] : pools) {
    for (int k = 0; k < count; ++k) points_[i++].second = sum / count;
  }
}

double PiecewiseCost::at(double bytes) const {
  if (points_.empty()) return std::numeric_limits<double>::infinity();
  if (bytes <= points_.front().first) return points_.front().second;
  const auto& last = points_.back();
  if (bytes >= last.first) return last.second * bytes / last.first;
  auto hi = std::upper_bound(points_.begin(), points_.end(), std::make_pair(bytes, 0.0),
                             [](auto& a, auto& b) { return a.first < b.first; });
  auto lo = hi - 1;
  // The band's alpha-beta line, through both measured ends.
  const double beta = (hi->second - lo->second) / (hi->first - lo->first);
  const double alpha = lo->second - beta * lo->first;
  return alpha + beta * bytes;
}

Algorithm CostModel::best(double bytes) const {
  Algorithm best = Algorithm::Engine;
  double best_us = std::numeric_limits<double>::infinity();
  for (auto& [a, cost] : costs_) {
    if (a == Algorithm::Engine) continue;
    if (cost.at(bytes) < best_us) {
      best_us = cost.at(bytes);
      best = a;
    }
  }
  auto engine = costs_.find(Algorithm::Engine);
  if (engine != costs_.end() && !(best_us < (1 - kEngineMargin) * engine->second.at(bytes))) {
    return Algorithm::Engine;
  }
  return best;
}

CostModel CostModel::fit(const std::vector<Sample>& samples) {
  std::map<Algorithm, std::vector<std::pair<double, double>>> by_algo;
  for (auto& s : samples) by_algo[s.algo].emplace_back(s.bytes, s.us);
  CostModel m;
  for (auto& [a, points] : by_algo) m.set(a, PiecewiseCost(std::move(points)));
  return m;
}

std::string CostModel::serialize() const {
  std::string out;
  char buf[64];
  for (auto& [a, cost] : costs_) {
    out += to_string(a);
    for (auto& [bytes, us] : cost.points()) {
      std::snprintf(buf, sizeof buf, " %.0f:%.9g", bytes, us);
      out += buf;
    }
    out += ';';
  }
  return out;
}

CostModel CostModel::parse(const std::string& text) {
  CostModel m;
  std::istringstream in(text);
  std::string entry;
  while (std::getline(in, entry, ';')) {
    if (entry.empty()) continue;
    std::istringstream fields(entry);
    std::string name, point;
    fields >> name;
    auto a = parse_algorithm(name);
    std::vector<std::pair<double, double>> points;
    bool ok = a.has_value() && *a != Algorithm::Adaptive && *a != Algorithm::Default;
    while (ok && fields >> point) {
      const auto colon = point.find(':');
      char* end = nullptr;
      double bytes = 0, us = 0;
      if (colon != std::string::npos) {
        bytes = std::strtod(point.c_str(), &end);
        ok = end == point.c_str() + colon;
        us = std::strtod(point.c_str() + colon + 1, &end);
        ok = ok && *end == '\0' && bytes > 0 && us >= 0;
      } else {
        ok = false;
      }
      points.emplace_back(bytes, us);
    }
    if (!ok || points.empty()) {
      throw Error("cohort: unreadable algorithm cost model entry '" + entry + "'");
    }
    m.set(*a, PiecewiseCost(std::move(points)));
  }
  return m;
}

}  // namespace cohort::algorithms
