#include "cohort/algorithms/cost_model.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>

#include "cohort/comm/error.h"

namespace cohort::algorithms {

LinearCost fit_line(const std::vector<std::pair<double, double>>& points) {
  // Minimize sum w (a + b n - t)^2 with w = 1/t^2.
  double sw = 0, sn = 0, snn = 0, st = 0, snt = 0;
  for (auto [n, t] : points) {
    const double w = 1.0 / std::max(t * t, 1e-12);
    sw += w;
    sn += w * n;
    snn += w * n * n;
    st += w * t;
    snt += w * n * t;
  }
  LinearCost c;
  const double det = sw * snn - sn * sn;
  if (points.size() >= 2 && det > 0) {
    c.alpha_us = (st * snn - sn * snt) / det;
    c.beta_us_per_b = (sw * snt - sn * st) / det;
  }
  if (points.size() < 2 || det <= 0 || c.alpha_us < 0 || c.beta_us_per_b < 0) {
    // Refit with the offending term pinned at zero; keep the better one.
    LinearCost only_beta{0, snn > 0 ? snt / snn : 0};
    LinearCost only_alpha{sw > 0 ? st / sw : 0, 0};
    auto err = [&](const LinearCost& l) {
      double e = 0;
      for (auto [n, t] : points) e += (l.at(n) - t) * (l.at(n) - t) / std::max(t * t, 1e-12);
      return e;
    };
    c = err(only_beta) <= err(only_alpha) ? only_beta : only_alpha;
  }
  return c;
}

Algorithm CostModel::best(double bytes) const {
  Algorithm best = Algorithm::Engine;
  double best_us = std::numeric_limits<double>::infinity();
  for (auto& [a, line] : lines_) {
    if (line.at(bytes) < best_us) {
      best_us = line.at(bytes);
      best = a;
    }
  }
  return best;
}

CostModel CostModel::fit(const std::vector<Sample>& samples) {
  std::map<Algorithm, std::vector<std::pair<double, double>>> by_algo;
  for (auto& s : samples) by_algo[s.algo].emplace_back(s.bytes, s.us);
  CostModel m;
  for (auto& [a, points] : by_algo) m.set(a, fit_line(points));
  return m;
}

std::string CostModel::serialize() const {
  std::string out;
  char buf[128];
  for (auto& [a, line] : lines_) {
    std::snprintf(buf, sizeof buf, "%s %.9g %.9g;", to_string(a).c_str(), line.alpha_us,
                  line.beta_us_per_b);
    out += buf;
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
    std::string name;
    LinearCost line;
    fields >> name >> line.alpha_us >> line.beta_us_per_b;
    auto a = parse_algorithm(name);
    if (!a || fields.fail()) {
      throw Error("cohort: unreadable algorithm cost model entry '" + entry + "'");
    }
    m.set(*a, line);
  }
  return m;
}

}  // namespace cohort::algorithms
