// defines: the cases pipeline_job runs as processes and the process test
// checks against one process: schedule, v, m, their batches and the
// optimizer's settings, shared so that both sides agree.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "pipeline_test_models.h"

namespace cohort::pipeline::testing {

constexpr int kJobSteps = 2;
constexpr double kJobLr = 0.1;

struct JobCase {
  std::string schedule;  // make_schedule's name
  int v, m;
  std::string name() const {
    return schedule + "_v" + std::to_string(v) + "_m" + std::to_string(m);
  }
};

// At pp = 2: 1F1B, ZB-H1 and interleaved with two virtual stages per rank.
inline std::vector<JobCase> job_cases() {
  return {{"1f1b", 1, 4}, {"zbh1", 1, 3}, {"interleaved", 2, 4}};
}

// Step `step`'s batch (inputs, targets): 2 samples per micro-batch.
inline std::pair<torch::Tensor, torch::Tensor> job_batch(const JobCase& c, int step) {
  const int64_t n = 2 * c.m;
  return {det({n, kWidth}, 0.4 + step), det({n, kWidth}, 1.3 + step)};
}

}  // namespace cohort::pipeline::testing
