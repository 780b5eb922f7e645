// defines: CostModel, the alpha-beta model adaptive picks algorithms with,
// and fit_line.
//
// For each (operation, algorithm) the model holds t(n) = alpha + beta * n
// (microseconds; n = bytes of the whole vector, nccl-tests' convention),
// fitted to times measured on this job's links at calibration. The textbook
// forms (ring: 2(p-1) a + 2(p-1)/p n b, ...) are what each fitted line
// stands for; fitting the lines directly also captures what the textbook
// leaves out (per-message software cost, copies, the engine's own choice).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cohort/algorithms/algorithm.h"

namespace cohort::algorithms {


struct LinearCost {
  double alpha_us = 0;       // fixed cost per operation
  double beta_us_per_b = 0;  // cost per byte of the vector
  double at(double bytes) const { return alpha_us + beta_us_per_b * bytes; }
};

// One measurement: `algo` took `us` for `bytes` (slowest rank, median).
struct Sample {
  Algorithm algo;
  double bytes;
  double us;
};

// Least squares on the relative error (weights 1/t^2), so small sizes count
// as much as large ones; alpha and beta are kept non-negative.
LinearCost fit_line(const std::vector<std::pair<double, double>>& points);

class CostModel {
 public:
  void set(Algorithm a, LinearCost c) { lines_[a] = c; }
  bool empty() const { return lines_.empty(); }
  const std::map<Algorithm, LinearCost>& lines() const { return lines_; }
  // The algorithm with the lowest predicted time for `bytes`.
  Algorithm best(double bytes) const;

  static CostModel fit(const std::vector<Sample>& samples);
  // "ring 12.5 0.00081;hd ..." (same text on every rank).
  std::string serialize() const;
  static CostModel parse(const std::string& text);

 private:
  std::map<Algorithm, LinearCost> lines_;
};

}  // namespace cohort::algorithms
