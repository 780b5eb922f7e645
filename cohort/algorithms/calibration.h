// defines: calibrate, the short measurement at a group's first adaptive
// collective that the cost model is built from.
//
// Each candidate algorithm runs at the sizes of kCalibrationPoints in
// blocks of back-to-back runs (after a warm-up), the candidates taking
// turns in balanced_order so that machine noise hits all alike; the
// candidates within kContenderMargin of the fastest then run as many blocks
// again. Each point is loop_cost of its timed runs on the slowest rank (one
// MAX reduction per size, so every rank holds the same numbers). The runs
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
#include "cohort/core/engine.h"
#include "cohort/core/store/store.h"

namespace cohort::algorithms {

// The sizes measured (bytes of the whole vector: every fourth power of two
// from 1 KiB to 64 MiB; the engines change behaviour anywhere in between:
// Open MPI's all_reduce at world 2 here loses 65% of its bandwidth from 16
// to 32 MiB), the timed runs per block at each and the blocks per
// candidate: more of both where a run is short and noise is relatively
// large. Its duration: docs/benchmarks.md,
// "Collective algorithms side by side".
struct CalibrationPoint {
  int64_t bytes;
  int runs;
  int blocks;
};
inline constexpr CalibrationPoint kCalibrationPoints[] = {
    {1 << 10, 15, 3},   {4 << 10, 15, 3}, {16 << 10, 15, 3}, {64 << 10, 12, 3},
    {256 << 10, 10, 3}, {1 << 20, 6, 3},  {4 << 20, 4, 3},   {16 << 20, 3, 3},
    {64 << 20, 2, 2}};

// Each block starts with untimed runs of its candidate, for at least this
// long on every rank, so that it is timed in the state a loop of that
// algorithm runs in (thread placement settled, TCP windows open again after
// the other candidates' turns). Measured (Gloo, world 2): after a switch
// from another algorithm, Gloo's all_reduce at 256 KiB-1 MiB ran 1.5x
// slower for its first 10-15 ms, and with one untimed run calibration had
// it 2x slower than its loop. Time, not a count of runs: the settling is
// the scheduler's, which tracks time; but no more than
// kCalibrationWarmupRuns runs, which is plenty where an operation takes
// microseconds (MPI's polling ranks have no threads to re-place).
inline constexpr double kCalibrationWarmupUs = 25'000;
inline constexpr int kCalibrationWarmupRuns = 100;

// After the first pass at a size, the candidates predicted within this
// fraction of the fastest run a second pass of as many blocks.
inline constexpr double kContenderMargin = 0.25;

// What a loop of these runs costs per operation: the mean of the fastest
// 90% of them. Not the median: on this VM 2-10% of operations stall for one
// or two host scheduler ticks (4 or 8 ms against ~250 us), and for some
// algorithms at some sizes far more often (ring at 256 KiB-2 MiB over Gloo:
// a third of its runs); a loop pays every stall, and the median had ring
// 13% faster than Gloo's all_reduce at 256 KiB where its loop ran 3.8x
// slower. Not the plain mean either: the few-percent stalls hit every
// algorithm alike, and how many land in 50 runs is chance (the plain mean
// then picked ring at 2-64 KiB, where its loop ran at 0.73-0.87 of the
// engine's). Leaving out the slowest tenth drops those and keeps a stall
// rate that belongs to the algorithm.
double loop_cost(std::vector<double> runs);

// Calibration stops after the first size at which even the fastest
// candidate took longer than this per run: the larger sizes would take
// seconds to measure, and the model extrapolates bandwidth-bound beyond.
inline constexpr double kCalibrationRunBudgetUs = 50'000;

// Position j of round `round` when `n` candidates take turns: a Williams
// design, so over n rounds (2n when n is odd) each candidate runs right
// after each other one equally often. Plain rotation (round r starts at
// candidate r) keeps one cyclic order, so every candidate always follows
// the same one: in cohort-bench the engine's column always followed
// adaptive's, which had just run the same collective.
size_t balanced_order(size_t n, int round, size_t j);

struct Calibration {
  CostModel model;
  std::vector<Sample> samples;  // what the model was built from
  double seconds = 0;           // how long calibration took on this rank
};

// `c` as text: its duration, the model, then every sample (algo bytes us).
std::string describe(Collective op, const Calibration& c);

// `run(algo, bytes, vote)` performs one operation of `bytes` with `algo`,
// returns when it finished, and returns the sum of the ranks' `vote`s (the
// operation carries them: it is how the ranks agree to end a warm-up).
// `engine` carries the MAX reduction of the measured times. Sizes above
// `max_bytes` are not measured (the first always is).
Calibration calibrate(Engine& engine, Store& store, Collective op,
                      const std::vector<Algorithm>& candidates,
                      const std::function<double(Algorithm, int64_t, double)>& run, Millis timeout,
                      int64_t max_bytes = 64 << 20);

}  // namespace cohort::algorithms
