// defines: CostModel, the measured alpha-beta model adaptive picks algorithms
// with, and PiecewiseCost, one algorithm's part of it.
//
// For each (operation, algorithm) the model holds the times measured at
// calibration sizes n_0 < n_1 < ... (n = bytes of the whole vector,
// nccl-tests' convention). Between two measured sizes the cost is the
// alpha-beta line through both, t(n) = alpha_k + beta_k n: alpha_k is the
// latency term and beta_k the inverse bandwidth of that size band. One line
// per algorithm over the whole range cannot describe the engines here:
// Gloo's per-message rendezvous, protocol switches inside MPI and Gloo, and
// the caches make beta change by 10x between 64 KiB and 16 MiB, so a single
// least-squares line misranked algorithms by 2-4x in the middle sizes.
// Below n_0 the cost is t(n_0) (latency bound); above the last size it
// scales with n (bandwidth bound).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/algorithm.h"

namespace cohort::algorithms {

// One measurement: `algo` took `us` for `bytes` (slowest rank, loop_cost).
struct Sample {
  Algorithm algo;
  double bytes;
  double us;
};

class PiecewiseCost {
 public:
  PiecewiseCost() = default;
  // (bytes, us) points, any order, distinct sizes. Times are made
  // non-decreasing in size first, by the isotonic least-squares fit (a run
  // of points that falls with size is replaced by its mean): a bigger
  // message is never cheaper. Not a running minimum: the measured times are
  // means that chance stalls move both ways, and one lucky larger size
  // lowered all smaller ones (world 4 here: the engine's 256 KiB point at
  // half its loop time pulled its 1-64 KiB points down with it).
  explicit PiecewiseCost(std::vector<std::pair<double, double>> points);
  double at(double bytes) const;
  // The smoothed points, ascending by size.
  const std::vector<std::pair<double, double>>& points() const { return points_; }
  bool empty() const { return points_.empty(); }

 private:
  std::vector<std::pair<double, double>> points_;
};

class CostModel {
 public:
  // Another algorithm replaces the engine's own collective only where it is
  // predicted at least this much faster. The engine's collective is tuned
  // by its authors and runs with no hand-off to the algorithm worker; on a
  // shared machine a short calibration misjudges the point-to-point
  // algorithms (their many thread wake-ups are the noisiest part), and a
  // near-tie is more likely noise than a real difference. Keeping the
  // engine on a near-tie costs at most this fraction.
  static constexpr double kEngineMargin = 0.10;

  void set(Algorithm a, PiecewiseCost c) { costs_[a] = std::move(c); }
  bool empty() const { return costs_.empty(); }
  const std::map<Algorithm, PiecewiseCost>& costs() const { return costs_; }
  // The algorithm predicted fastest for `bytes`.
  Algorithm best(double bytes) const;

  static CostModel fit(const std::vector<Sample>& samples);
  // "engine 1024:35.2 4096:41 ...;ring ...;" (the same text on every rank).
  std::string serialize() const;
  static CostModel parse(const std::string& text);

 private:
  std::map<Algorithm, PiecewiseCost> costs_;
};

}  // namespace cohort::algorithms
