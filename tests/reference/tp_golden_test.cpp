// Golden test against PyTorch's own tensor parallelism (DTensor's
// parallelize_module with ColwiseParallel and RowwiseParallel, PyTorch 2.x):
// the MLP Linear(kWidth, kHidden), Tanh, Linear(kHidden, kWidth) with an MSE
// loss, from the same full weights (master_linear_weights) and batch,
// trained for kSteps SGD steps by tests/reference/tp_reference.py (tp gloo
// processes) and by cohort's ColumnParallelLinear and RowParallelLinear (tp
// ranks as threads). Every rank's loss at every step and every rank's
// parameter shards after training must agree within kTolerance with the
// peer's. Each case's negative control is the same comparison against a run
// of the peer with one thing changed (a weight, the learning rate), which it
// must reject. Skipped where the PyTorch has no DTensor TP (1.13, Debian 12).
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "cohort/tensor_parallel/layers.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "support/torch_peer.h"

namespace cohort::testing::tp_golden_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kWidth = 8, kHidden = 12, kBatch = 5;
const std::string kScript = REFERENCE_DIR "/tp_reference.py";
constexpr int kSteps = 3;
constexpr double kLr = 0.1;
constexpr uint64_t kSeed1 = 3, kSeed2 = 4;
// The same float32 operations on both sides, but the row-parallel partial
// sums are added in the engines' orders: measured differences are below
// 6e-8.
constexpr double kTolerance = 1e-5;

struct Case {
  int tp;
  std::string control;  // what the negative control changes (see the script)
};

void PrintTo(const Case& c, std::ostream* os) { *os << "tp " << c.tp << ", control " << c.control; }

struct Trained {
  std::vector<std::vector<double>> losses;         // [rank][step]
  std::vector<std::vector<torch::Tensor>> params;  // [rank]: w1, b1, w2, b2 (shards)
};

Trained train_cohort(int tp, const torch::Tensor& x, const torch::Tensor& y) {
  Trained out;
  out.losses.resize(tp);
  out.params.resize(tp);
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    ColumnParallelLinearOptions co;
    co.seed = kSeed1;
    RowParallelLinearOptions ro;
    ro.seed = kSeed2;
    ColumnParallelLinear col(cohort::DeviceMesh::from_group(g, "tp"), kWidth, kHidden, co);
    RowParallelLinear row(cohort::DeviceMesh::from_group(g, "tp"), kHidden, kWidth, ro);
    std::vector<torch::Tensor> params{col->weight, col->bias, row->weight, row->bias};
    torch::optim::SGD opt(params, torch::optim::SGDOptions(kLr));
    const int r = g->rank();
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto loss = torch::nn::functional::mse_loss(row(torch::tanh(col(x))), y);
      loss.backward();
      opt.step();
      out.losses[r].push_back(loss.item<double>());
    }
    for (const auto& p : params) out.params[r].push_back(p.detach().clone());
  });
  return out;
}

// The largest absolute difference between cohort's run and the peer's run
// `name`: every rank's losses, and every rank's shards against the same
// slices of the peer's whole parameters.
double max_difference(const Trained& mine, const std::string& dir, const std::string& name,
                      int tp) {
  const int64_t split_dim[] = {0, 0, 1, -1};  // -1: whole on every rank
  double diff = 0;
  for (int r = 0; r < tp; ++r) {
    auto theirs = read_raw(dir + "/" + name + "_losses_" + std::to_string(r) + ".bin", {kSteps});
    for (int s = 0; s < kSteps; ++s)
      diff = std::max(diff, std::abs(mine.losses[r][s] - theirs[s].item<double>()));
    for (size_t k = 0; k < 4; ++k) {
      auto shape = mine.params[r][k].sizes().vec();
      if (split_dim[k] >= 0) shape[split_dim[k]] *= tp;
      auto whole = read_raw(dir + "/" + name + "_param_" + std::to_string(k) + ".bin", shape);
      auto slice = split_dim[k] >= 0 ? whole.chunk(tp, split_dim[k])[r] : whole;
      diff = std::max(diff, (mine.params[r][k] - slice).abs().max().item<double>());
    }
  }
  return diff;
}

class PyTorchTensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(PyTorchTensorParallel, MatchesDTensorColwiseRowwise) {
  const Case c = GetParam();
  static const std::optional<std::string> missing = probe_torch_peer(kScript);  // once
  if (missing) GTEST_SKIP() << *missing;
  TempDir dir("cohort-tp-golden");
  auto [w1, b1] = master_linear_weights(kWidth, kHidden, kSeed1);
  auto [w2, b2] = master_linear_weights(kHidden, kWidth, kSeed2);
  const std::vector<torch::Tensor> init{w1, b1, w2, b2};
  for (size_t k = 0; k < init.size(); ++k)
    write_raw(dir / ("init_" + std::to_string(k) + ".bin"), init[k]);
  const auto x =
      torch::sin(torch::arange(kBatch * kWidth, torch::kFloat32) * 0.37).reshape({kBatch, kWidth});
  const auto y =
      torch::cos(torch::arange(kBatch * kWidth, torch::kFloat32) * 0.53).reshape({kBatch, kWidth});
  write_raw(dir / "x.bin", x);
  write_raw(dir / "y.bin", y);
  const std::string failed = run_torch_peers(
      kScript,
      {"--dir", dir.str(), "--steps", std::to_string(kSteps), "--batch", std::to_string(kBatch),
       "--width", std::to_string(kWidth), "--hidden", std::to_string(kHidden), "--lr",
       std::to_string(kLr), "--run", "ref:none", "--run", "ctl:" + c.control},
      c.tp, 60);
  ASSERT_EQ(failed, "");

  const Trained mine = train_cohort(c.tp, x, y);
  const double diff = max_difference(mine, dir.str(), "ref", c.tp);
  const double control = max_difference(mine, dir.str(), "ctl", c.tp);
  expect_golden(diff, control, kTolerance, "tp " + std::to_string(c.tp) + ", control " + c.control);
  // Training moved the parameters: the comparison is not of initial values.
  EXPECT_GT((mine.params[0][2] - w2.chunk(c.tp, 1)[0]).abs().max().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Dtensor, PyTorchTensorParallel,
                         ::testing::Values(Case{2, "weight"}, Case{3, "lr"}),
                         [](const auto& info) { return "tp" + std::to_string(info.param.tp); });

}  // namespace
}  // namespace cohort::testing::tp_golden_test
