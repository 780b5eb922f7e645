#include "cohort/algorithms/calibration.h"

#include <algorithm>
#include <chrono>

namespace cohort::algorithms {

double loop_cost(std::vector<double> runs) {
  if (runs.empty()) return 0;
  std::sort(runs.begin(), runs.end());
  runs.resize(runs.size() - runs.size() / 10);
  double sum = 0;
  for (double r : runs) sum += r;
  return sum / static_cast<double>(runs.size());
}

size_t balanced_order(size_t n, int round, size_t j) {
  const size_t period = n % 2 == 0 ? n : 2 * n;
  const size_t r = static_cast<size_t>(round) % period;
  // Odd n: the second n rounds run the first n backwards.
  if (r >= n) j = n - 1 - j;
  // Base row 0, n-1, 1, n-2, ...: its steps are all different mod n.
  const size_t base = j % 2 == 0 ? j / 2 : n - (j + 1) / 2;
  return (base + r) % n;
}

namespace {

// Rank 0's model of `c`'s samples, the one every rank uses.
CostModel rank_zeros_model(Engine& engine, Store& store, Collective op, const Calibration& c,
                           Millis timeout) {
  const std::string key = "cost_model/" + to_string(op);
  if (engine.rank() == 0) store.set_string(key, CostModel::fit(c.samples).serialize());
  store.wait({key}, timeout);
  return CostModel::parse(store.get_string(key));
}

}  // namespace

Calibration calibrate(Engine& engine, Store& store, Collective op,
                      const std::vector<Algorithm>& candidates,
                      const std::function<double(Algorithm, int64_t, double)>& run, Millis timeout,
                      int64_t max_bytes) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto warmup_time = std::chrono::microseconds(static_cast<int64_t>(kCalibrationWarmupUs));
  const double ranks = engine.size();
  // Blocks of runs alternate between the candidates, so a burst of machine
  // noise hits all of them alike.
  Calibration c;
  for (const auto& point : kCalibrationPoints) {
    const int64_t bytes = point.bytes;
    if (bytes > max_bytes && !c.samples.empty()) break;
    std::vector<std::vector<double>> runs(candidates.size());
    // The candidates take turns in balanced_order: what ran just before
    // shifts a run's time on a small machine (thread placement,
    // connections' state); always following the point-to-point algorithms,
    // the engine's collective read 25% slower.
    auto measure = [&](const std::vector<size_t>& who, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        for (size_t j = 0; j < who.size(); ++j) {
          const size_t a = who[balanced_order(who.size(), b, j)];
          // Untimed runs first, until every rank has spent
          // kCalibrationWarmupUs or kCalibrationWarmupRuns on them; the runs
          // carry the ranks' votes, so all stop after the same run.
          const auto warm_start = Clock::now();
          for (int i = 1;; ++i) {
            const bool warm = i >= kCalibrationWarmupRuns || Clock::now() - warm_start >= warmup_time;
            if (run(candidates[a], bytes, warm ? 1.0 : 0.0) >= ranks) break;
          }
          for (int i = 0; i < point.runs; ++i) {
            const auto t0 = Clock::now();
            run(candidates[a], bytes, 0.0);
            runs[a].push_back(
                std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          }
        }
      }
    };
    // Every rank takes the slowest rank's figures (so all hold the same
    // numbers, choose the same contenders and stop at the same size).
    auto agreed = [&] {
      std::vector<double> typical;
      for (auto& v : runs) typical.push_back(loop_cost(v));
      auto slowest = at::tensor(typical, at::kDouble);
      engine.all_reduce(slowest, ReduceOp::Max)->wait(timeout);
      std::vector<double> out(candidates.size());
      for (size_t a = 0; a < candidates.size(); ++a) {
        out[a] = slowest[static_cast<int64_t>(a)].item<double>();
      }
      return out;
    };
    std::vector<size_t> all(candidates.size());
    for (size_t a = 0; a < all.size(); ++a) all[a] = a;
    measure(all, point.blocks);
    auto cost = agreed();
    // A race: the candidates within kContenderMargin of the fastest run as
    // many blocks again, so the close calls get twice the samples and the
    // clear losers cost nothing more.
    const double fastest = *std::min_element(cost.begin(), cost.end());
    std::vector<size_t> contenders;
    for (size_t a = 0; a < all.size(); ++a) {
      if (cost[a] <= fastest * (1 + kContenderMargin)) contenders.push_back(a);
    }
    if (contenders.size() > 1) {
      measure(contenders, point.blocks);
      cost = agreed();
    }
    for (size_t a = 0; a < candidates.size(); ++a) {
      c.samples.push_back({candidates[a], static_cast<double>(bytes), cost[a]});
    }
    // On a slow link the big sizes are bandwidth bound already; measuring
    // them would cost seconds (37 s at 1 Gbit/s with 64 MiB measured).
    if (*std::min_element(cost.begin(), cost.end()) > kCalibrationRunBudgetUs) break;
  }
  c.model = rank_zeros_model(engine, store, op, c, timeout);
  c.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return c;
}

std::string describe(Collective op, const Calibration& c) {
  std::string s =
      to_string(op) + " calibrated in " + std::to_string(static_cast<int>(c.seconds * 1000)) +
      " ms; model (bytes:us, smoothed): " + c.model.serialize() + " samples (algo bytes us):";
  for (auto& x : c.samples) {
    s += " " + to_string(x.algo) + " " + std::to_string(static_cast<int64_t>(x.bytes)) + " " +
         std::to_string(x.us) + ";";
  }
  return s;
}

}  // namespace cohort::algorithms
