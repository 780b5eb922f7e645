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
  // noise hits all of them alike; a point is the median over blocks of the
  // mean time per run: what a training loop issuing these back to back sees
  // (wake-up delays included, which a fastest-run figure would hide).
  std::vector<double> typical;
  for (size_t s = 0; s < std::size(kCalibrationSizes); ++s) {
    const int64_t bytes = kCalibrationSizes[s];
    std::vector<std::vector<double>> blocks(candidates.size());
    for (int b = 0; b < kCalibrationBlocks; ++b) {
      for (size_t a = 0; a < candidates.size(); ++a) {
        // One untimed run first: each block then starts from the state a
        // loop of this algorithm runs in (its TCP connections' congestion
        // windows open again after the other candidates' turns).
        run(candidates[a], bytes);
        const auto t0 = Clock::now();
        for (int i = 0; i < kCalibrationRuns[s]; ++i) run(candidates[a], bytes);
        blocks[a].push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
            kCalibrationRuns[s]);
      }
    }
    for (auto& v : blocks) {
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      typical.push_back(v[v.size() / 2]);
    }
  }
  auto slowest = at::tensor(typical, at::kDouble);
  engine.all_reduce(slowest, ReduceOp::Max)->wait(timeout);

  Calibration c;
  size_t i = 0;
  for (int64_t bytes : kCalibrationSizes) {
    for (auto algo : candidates) {
      c.samples.push_back({algo, static_cast<double>(bytes), slowest[static_cast<int64_t>(i++)].item<double>()});
    }
  }
  // Rank 0's fit is the one every rank uses.
  const std::string key = "cost_model/" + to_string(op);
  if (engine.rank() == 0) store.set_string(key, CostModel::fit(c.samples).serialize());
  store.wait({key}, timeout);
  c.model = CostModel::parse(store.get_string(key));
  c.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return c;
}

}  // namespace cohort::algorithms
