// defines: calibrate, the short measurement at a group's first adaptive
// collective that the cost model is built from.
//
// Each candidate algorithm runs at the sizes of kCalibrationPoints in
// blocks of back-to-back runs (after one untimed run), the candidates
// rotating block by block so that machine noise hits all alike; each point
// is the median of its timed runs, on the slowest rank (one MAX reduction
// of all points at the end, so every rank holds the same numbers). The runs
// are issued and waited for the way a training loop does (see
// Executor::calibration). Rank 0 builds the model and publishes it in the
// group's store; every rank reads it back from there, so all ranks choose
// identically. The model is kept for the group's lifetime (calibration runs
// once per group and operation).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "cohort/algorithms/cost_model.h"
#include "cohort/comm/engine.h"
#include "cohort/comm/store/store.h"

namespace cohort::algorithms {

// The sizes measured (bytes of the whole vector: every fourth power of two
// from 1 KiB to 64 MiB; the engines change behaviour anywhere in between:
// Open MPI's all_reduce at world 2 here loses 65% of its bandwidth from 16
// to 32 MiB), the timed runs per block at each and the blocks per
// candidate: more of both where a run is short and noise is relatively
// large. About 2.5 s at world 2 here (Gloo, loopback).
struct CalibrationPoint {
  int64_t bytes;
  int runs;
  int blocks;
};
inline constexpr CalibrationPoint kCalibrationPoints[] = {
    {1 << 10, 8, 5},   {4 << 10, 8, 5}, {16 << 10, 8, 5}, {64 << 10, 4, 5},
    {256 << 10, 4, 5}, {1 << 20, 4, 5}, {4 << 20, 2, 4},  {16 << 20, 3, 3},
    {64 << 20, 2, 2}};

// Calibration stops after the first size at which even the fastest
// candidate took longer than this per run: the larger sizes would take
// seconds to measure, and the model extrapolates bandwidth-bound beyond.
inline constexpr double kCalibrationRunBudgetUs = 50'000;

struct Calibration {
  CostModel model;
  std::vector<Sample> samples;  // what the model was built from
  double seconds = 0;           // how long calibration took on this rank
};

// `run(algo, bytes)` performs one operation of `bytes` with `algo` and
// returns when it finished. `engine` carries the final MAX reduction.
Calibration calibrate(Engine& engine, Store& store, Collective op,
                      const std::vector<Algorithm>& candidates,
                      const std::function<void(Algorithm, int64_t)>& run, Millis timeout);

}  // namespace cohort::algorithms
