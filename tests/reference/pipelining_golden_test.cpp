// Golden test against PyTorch's own pipeline schedules
// (torch.distributed.pipelining, PyTorch 2.x): the same MLP, initial
// weights, batch, micro-batch count and loss trained for kSteps SGD steps by
// tests/reference/pipelining_reference.py (pp gloo processes) and by cohort's
// PipelineRuntime (pp ranks as threads), for GPipe, 1F1B and interleaved
// 1F1B. Every micro-batch loss of every step and every parameter after
// training must agree within kTolerance. Each case's negative control is the
// same comparison against a run of the same peer with one thing changed
// (a weight, PyTorch's summed loss, the learning rate), which it must reject.
// Skipped where the PyTorch has no pipelining (1.13, Debian 12).
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "support/torch_peer.h"
#include "tests/pipeline/pipeline_test_models.h"

namespace cohort::testing::pipelining_golden_test {
namespace {

using namespace cohort::pipeline;
using pipeline::testing::det;
using pipeline::testing::kWidth;

const std::string kScript = REFERENCE_DIR "/pipelining_reference.py";
constexpr int kSteps = 3;
constexpr double kLr = 0.1;
// Both sides run the same float32 operations on the same micro-batches;
// measured differences are below 3e-7 (losses) and 6e-8 (parameters).
constexpr double kTolerance = 1e-5;

struct Case {
  std::string schedule;  // cohort's make_schedule name, also the peer's
  int pp, v, m;
  std::string control;  // what the negative control changes (see the script)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.schedule << " pp " << c.pp << " v " << c.v << " m " << c.m << ", control " << c.control;
}

struct Trained {
  std::vector<std::vector<double>> losses;  // [step][micro-batch]
  std::vector<torch::Tensor> params;        // the model's, each from its stage's rank
};

Trained train_cohort(const Case& c, const torch::Tensor& x, const torch::Tensor& y) {
  const int stages = c.pp * c.v;
  Trained out;
  out.params.resize(2 * stages);
  run_ranks_shared(c.pp, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
    auto model = pipeline::testing::make_mlp(stages);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(comm->rank()))
      mine.emplace_back(s, split_sequential(model, pipeline::testing::mlp_boundaries(stages), s));
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule,
                       pipeline::testing::mse);
    torch::optim::SGD opt(rt.parameters(), torch::optim::SGDOptions(kLr));
    const bool last = schedule.stages_of(comm->rank()).back() == stages - 1;
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto result = rt.step({x}, {y});
      opt.step();
      if (last) out.losses.push_back(result.losses);
    }
    auto params = model->parameters();  // weight 2s, bias 2s+1 of stage s
    for (int s : schedule.stages_of(comm->rank()))
      for (int k : {2 * s, 2 * s + 1}) out.params[k] = params[k].detach().clone();
  });
  return out;
}

// The largest absolute difference between cohort's run and the peer's run
// `name`, over every loss and parameter.
double max_difference(const Trained& mine, const std::string& dir, const std::string& name, int m) {
  auto theirs = read_raw(dir + "/" + name + "_losses.bin", {kSteps, m});
  double diff = 0;
  for (int s = 0; s < kSteps; ++s)
    for (int i = 0; i < m; ++i)
      diff = std::max(diff, std::abs(mine.losses[s][i] - theirs[s][i].item<double>()));
  for (size_t k = 0; k < mine.params.size(); ++k) {
    auto p = read_raw(dir + "/" + name + "_param_" + std::to_string(k) + ".bin", mine.params[k]);
    diff = std::max(diff, (mine.params[k] - p).abs().max().item<double>());
  }
  return diff;
}

class PyTorchPipelining : public ::testing::TestWithParam<Case> {};

TEST_P(PyTorchPipelining, MatchesPyTorchSchedule) {
  const Case c = GetParam();
  static const std::optional<std::string> missing = probe_torch_peer(kScript);  // once
  if (missing) GTEST_SKIP() << *missing;
  const int stages = c.pp * c.v;
  TempDir dir("cohort-pipelining-golden");
  auto init = pipeline::testing::make_mlp(stages)->parameters();
  for (size_t k = 0; k < init.size(); ++k)
    write_raw(dir / ("init_" + std::to_string(k) + ".bin"), init[k]);
  const auto x = det({2 * c.m, kWidth}, 0.3), y = det({2 * c.m, kWidth}, 1.1);
  write_raw(dir / "x.bin", x);
  write_raw(dir / "y.bin", y);
  const std::string run = ":" + c.schedule + ":" + std::to_string(c.v) + ":" + std::to_string(c.m);
  const std::string failed = run_torch_peers(
      kScript,
      {"--dir", dir.str(), "--steps", std::to_string(kSteps), "--batch", std::to_string(2 * c.m),
       "--width", std::to_string(kWidth), "--lr", std::to_string(kLr), "--run",
       "ref" + run + ":none", "--run", "ctl" + run + ":" + c.control},
      c.pp, 60);
  ASSERT_EQ(failed, "");

  const Trained mine = train_cohort(c, x, y);
  ASSERT_EQ(mine.losses.size(), static_cast<size_t>(kSteps));
  const double diff = max_difference(mine, dir.str(), "ref", c.m);
  const double control = max_difference(mine, dir.str(), "ctl", c.m);
  expect_golden(diff, control, kTolerance, c.schedule + ", control " + c.control);
  // Training moved the parameters: the comparison is not of initial values.
  double moved = 0;
  for (size_t k = 0; k < init.size(); ++k)
    moved = std::max(moved, (mine.params[k] - init[k]).abs().max().item<double>());
  EXPECT_GT(moved, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Schedules, PyTorchPipelining,
                         ::testing::Values(Case{"gpipe", 2, 1, 4, "weight"},
                                           Case{"1f1b", 3, 1, 6, "sum"},
                                           Case{"interleaved", 2, 2, 4, "lr"}),
                         [](const auto& info) { return info.param.schedule; });

}  // namespace
}  // namespace cohort::testing::pipelining_golden_test
