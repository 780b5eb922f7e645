#include "cohort/algorithms/calibration.h"

#include <algorithm>
#include <chrono>

namespace cohort::algorithms {

Calibration calibrate(Engine& engine, Store& store, Collective op,
                      const std::vector<Algorithm>& candidates,
                      const std::function<void(Algorithm, int64_t)>& run, Millis timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::vector<double> medians;
  for (size_t s = 0; s < std::size(kCalibrationSizes); ++s) {
    const int64_t bytes = kCalibrationSizes[s];
    for (auto algo : candidates) {
      run(algo, bytes);  // warm-up: connections, scratch buffers, caches
      std::vector<double> us;
      for (int i = 0; i < kCalibrationRuns[s]; ++i) {
        const auto t0 = Clock::now();
        run(algo, bytes);
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
      medians.push_back(us[us.size() / 2]);
    }
  }
  auto slowest = at::tensor(medians, at::kDouble);
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
