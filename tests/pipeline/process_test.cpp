// The pipeline as real processes: cohortrun starts pipeline_job on 2 ranks,
// which runs 1F1B, ZB-H1 and interleaved (v = 2) for a few SGD steps; each
// rank's losses and its stages' parameters must equal one process on the
// whole batch within 1e-5 relative.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "pipeline_job_cases.h"
#include "support/subprocess.h"

namespace cohort::pipeline::testing::process_test {
namespace {

using cohort::testing::Seconds;
using cohort::testing::TempDir;

struct JobOutput {
  std::map<int, double> losses;               // by step
  std::map<int, std::vector<double>> params;  // by index in the whole model
};

JobOutput read_output(const std::string& path) {
  JobOutput out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string kind;
    int index = 0;
    fields >> kind >> index;
    if (kind == "loss") {
      fields >> out.losses[index];
      continue;
    }
    for (double v; fields >> v;) out.params[index].push_back(v);
  }
  return out;
}

struct Expected {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;  // flat, float64
};

// One process: the same steps on the whole batch.
Expected reference(const JobCase& c) {
  auto model = make_mlp(2 * c.v);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kJobLr));
  Expected e;
  for (int step = 0; step < kJobSteps; ++step) {
    auto [x, y] = job_batch(c, step);
    opt.zero_grad();
    auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    e.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->parameters())
    e.params.push_back(p.detach().to(torch::kFloat64).flatten());
  return e;
}

TEST(PipelineProcesses, CohortrunRunsEqualOneProcess) {
  TempDir dir("cohort-pipeline-job");
  const auto run =
      cohort::testing::run_cohortrun({"-n", "2", "--", PIPELINE_JOB_PATH, "--out", dir.str()},
                                     Seconds(60), {"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1"});
  ASSERT_FALSE(run.timed_out) << run.out << run.err;
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  for (const JobCase& c : job_cases()) {
    const Expected e = reference(c);
    std::set<int> held;
    for (int rank : {0, 1}) {
      const std::string what = c.name() + " rank " + std::to_string(rank);
      const auto out = read_output(dir / (c.name() + ".rank" + std::to_string(rank) + ".txt"));
      ASSERT_EQ(out.losses.size(), static_cast<size_t>(kJobSteps)) << what;
      for (int s = 0; s < kJobSteps; ++s)
        EXPECT_NEAR(out.losses.at(s), e.losses[s], 1e-5 * e.losses[s]) << what << " step " << s;
      for (const auto& [k, values] : out.params) {
        const torch::Tensor& want = e.params.at(static_cast<size_t>(k));
        ASSERT_EQ(static_cast<int64_t>(values.size()), want.numel()) << what;
        const auto got = torch::tensor(values, torch::kFloat64);
        EXPECT_LE((got - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>())
            << what << " parameter " << k;
        held.insert(k);
      }
    }
    EXPECT_EQ(held.size(), e.params.size()) << c.name() << ": every parameter on some rank";
  }
}

}  // namespace
}  // namespace cohort::pipeline::testing::process_test
