#include "cohort/algorithms/calibration.h"

#include <algorithm>
#include <chrono>

namespace cohort::algorithms {

Calibration calibrate(Engine& engine, Store& store, Collective op,
                      const std::vector<Algorithm>& candidates,
                      const std::function<void(Algorithm, int64_t)>& run, Millis timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Blocks of runs alternate between the candidates, so a burst of machine
  // noise hits all of them alike; a point is the median of all its timed
  // runs. Not the fastest run, which hides the wake-up delays a loop pays;
  // not the mean, which one descheduled run (here up to 4x the others) can
  // drag past a real difference between algorithms.
  Calibration c;
  for (const auto& point : kCalibrationPoints) {
    const int64_t bytes = point.bytes;
    std::vector<std::vector<double>> runs(candidates.size());
    for (int b = 0; b < point.blocks; ++b) {
      // Block b starts at candidate b: each follows each other equally
      // often. What ran just before shifts a run's time on a small machine
      // (thread placement, connections' state): always following the
      // point-to-point algorithms, the engine's collective read 25% slower.
      for (size_t j = 0; j < candidates.size(); ++j) {
        const size_t a = (static_cast<size_t>(b) + j) % candidates.size();
        // One untimed run first: each block then starts from the state a
        // loop of this algorithm runs in (its TCP connections' congestion
        // windows open again after the other candidates' turns).
        run(candidates[a], bytes);
        for (int i = 0; i < point.runs; ++i) {
          const auto t0 = Clock::now();
          run(candidates[a], bytes);
          runs[a].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
      }
    }
    std::vector<double> typical;
    for (auto& v : runs) {
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      typical.push_back(v[v.size() / 2]);
    }
    // Every rank takes the slowest rank's figures (so all hold the same
    // numbers, and stop at the same size below).
    auto slowest = at::tensor(typical, at::kDouble);
    engine.all_reduce(slowest, ReduceOp::Max)->wait(timeout);
    double fastest = slowest[0].item<double>();
    for (size_t a = 0; a < candidates.size(); ++a) {
      const double us = slowest[static_cast<int64_t>(a)].item<double>();
      c.samples.push_back({candidates[a], static_cast<double>(bytes), us});
      fastest = std::min(fastest, us);
    }
    // On a slow link the big sizes are bandwidth bound already; measuring
    // them would cost seconds (37 s at 1 Gbit/s with 64 MiB measured).
    if (fastest > kCalibrationRunBudgetUs) break;
  }
  // Rank 0's model is the one every rank uses.
  const std::string key = "cost_model/" + to_string(op);
  if (engine.rank() == 0) store.set_string(key, CostModel::fit(c.samples).serialize());
  store.wait({key}, timeout);
  c.model = CostModel::parse(store.get_string(key));
  c.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return c;
}

}  // namespace cohort::algorithms
