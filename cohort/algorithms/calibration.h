// defines: calibrate, the short measurement at a group's first adaptive
// collective that the cost model is fitted to.
//
// Each candidate algorithm runs at a few sizes (kCalibrationSizes) in
// blocks of back-to-back runs (after one untimed run), the candidates alternating block by block so
// that machine noise hits all alike; each point is the median block's mean,
// on the slowest rank (one MAX reduction of all points at the end, so every
// rank holds the same numbers). Rank 0
// fits the model and publishes it in the group's store; every rank reads it
// back from there, so all ranks choose identically. The model is kept for
// the group's lifetime (calibration runs once per group and operation).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "cohort/algorithms/cost_model.h"
#include "cohort/comm/engine.h"
#include "cohort/comm/store/store.h"

namespace cohort::algorithms {

// Vector sizes (bytes) measured, runs per block at each size, blocks per
// candidate.
inline constexpr int64_t kCalibrationSizes[] = {4 << 10, 64 << 10, 1 << 20, 8 << 20};
inline constexpr int kCalibrationRuns[] = {4, 4, 2, 1};  // timed runs per block
inline constexpr int kCalibrationBlocks = 3;

struct Calibration {
  CostModel model;
  std::vector<Sample> samples;  // what the model was fitted to
  double seconds = 0;           // how long calibration took on this rank
};

// `run(algo, bytes)` performs one operation of `bytes` with `algo` and
// returns when it finished. `engine` carries the final MAX reduction.
Calibration calibrate(Engine& engine, Store& store, Collective op,
                      const std::vector<Algorithm>& candidates,
                      const std::function<void(Algorithm, int64_t)>& run, Millis timeout);

}  // namespace cohort::algorithms
