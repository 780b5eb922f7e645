// Golden test against PyTorch's own DistributedDataParallel: the same
// model, initial weights and data trained by tests/reference/ddp_reference.py
// (two gloo processes started here with RANK/WORLD_SIZE/MASTER_* set) and by
// cohort (two ranks as threads). Each rank's per-step losses, rank 0's final
// parameters and every rank's buffers must match within 1e-5, for an MLP and
// for a CNN with BatchNorm. Two more cases pin PyTorch's buffer-broadcast
// rule (buffers go out before a forward whose predecessor was a synchronizing
// training forward): evaluating after training, where ranks other than 0
// must use rank 0's running statistics, and accumulation under no_sync(),
// where only the first micro-batch of each group broadcasts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "support/torch_peer.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::reference_test {
namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 20;
constexpr int kRows = 8;
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;

torch::nn::Sequential make_model(const std::string& kind) {
  using namespace torch::nn;
  if (kind == "mlp") return Sequential(Linear(20, 32), ReLU(), Linear(32, 10));
  return Sequential(Conv2d(Conv2dOptions(1, 4, 3)), BatchNorm2d(4), ReLU(), MaxPool2d(2), Flatten(),
                    Linear(36, 10));
}

std::vector<int64_t> input_shape(const std::string& kind) {
  return kind == "mlp" ? std::vector<int64_t>{20} : std::vector<int64_t>{1, 8, 8};
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

struct Case {
  std::string name;
  std::string model;
  int steps;
  int accum;  // micro-batches per optimizer step; the first accum-1 under no_sync()
  bool eval;  // evaluate once (no grad) after training
};

class PyTorchReference : public ::testing::TestWithParam<Case> {};

TEST_P(PyTorchReference, MatchesPyTorchDdp) {
  const Case c = GetParam();
  const std::string& kind = c.model;
  torch::set_num_threads(1);
  char tmpl[] = "/tmp/cohort_ddp_ref_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;

  torch::manual_seed(21);
  auto init_model = make_model(kind);
  const auto init = clone_all(init_model->parameters());
  for (size_t i = 0; i < init.size(); ++i)
    write_raw(dir + "/init_" + std::to_string(i) + ".bin", init[i]);
  std::vector<int64_t> xshape{c.steps, kWorld * kRows};
  for (auto d : input_shape(kind)) xshape.push_back(d);
  const auto x = torch::randn(xshape);
  const auto y = torch::randint(0, 10, {c.steps, kWorld * kRows}, torch::kLong);
  // Shifted so that batch and running statistics differ clearly.
  const auto x_eval = torch::randn(std::vector<int64_t>(xshape.begin() + 1, xshape.end())) * 2 + 1;
  write_raw(dir + "/x.bin", x);
  write_raw(dir + "/y.bin", y);
  write_raw(dir + "/x_eval.bin", x_eval);

  // Two PyTorch processes; `timeout` bounds the whole run so it cannot hang.
  std::ostringstream cmd;
  const std::string args = std::string(" ") + DDP_REFERENCE_SCRIPT + " --model " + kind +
                           " --dir " + dir + " --steps " + std::to_string(c.steps) + " --rows " +
                           std::to_string(kRows) + " --lr " + std::to_string(kLr) + " --momentum " +
                           std::to_string(kMomentum) + " --accum " + std::to_string(c.accum) +
                           (c.eval ? " --eval" : "");
  const std::string env =
      "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_loopback_port()) +
      " OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ";
  cmd << "timeout 100 sh -c '"
      << "RANK=0 " << env << DDP_REFERENCE_PYTHON << args << " > " << dir
      << "/log0 2>&1 & a=$!; RANK=1 " << env << DDP_REFERENCE_PYTHON << args << " > " << dir
      << "/log1 2>&1 & b=$!; wait $a; ra=$?; wait $b; rb=$?; exit $((ra | rb))'";
  const int rc = std::system(cmd.str().c_str());
  ASSERT_EQ(rc, 0) << cmd.str() << "\nrank 0:\n"
                   << slurp(dir + "/log0") << "\nrank 1:\n"
                   << slurp(dir + "/log1");

  std::vector<std::vector<float>> losses(kWorld);
  std::vector<std::vector<torch::Tensor>> buffers(kWorld), trained_buffers(kWorld);
  std::vector<torch::Tensor> params, evals(kWorld);
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = make_model(kind);
    if (r == 0) copy_parameters(*model, init);
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm);
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
    for (int s = 0; s < c.steps; ++s) {
      if (s % c.accum == 0) opt.zero_grad();
      const bool sync = (s + 1) % c.accum == 0;
      const auto step = [&] {
        auto loss = torch::cross_entropy_loss(ddp.forward(x[s].narrow(0, r * kRows, kRows)),
                                              y[s].narrow(0, r * kRows, kRows));
        loss.backward();
        return loss;
      };
      torch::Tensor loss;
      if (sync) {
        loss = step();
        opt.step();
      } else {
        NoSyncGuard guard = ddp.no_sync();
        loss = step();
      }
      losses[r].push_back(loss.item<float>());
    }
    trained_buffers[r] = clone_all(ddp.buffers());
    if (c.eval) {
      ddp.eval();
      torch::NoGradGuard no_grad;
      evals[r] = ddp.forward(x_eval.narrow(0, r * kRows, kRows)).clone();
    }
    buffers[r] = clone_all(ddp.buffers());
    if (r == 0) params = clone_all(ddp.parameters());
  });

  for (int r = 0; r < kWorld; ++r) {
    auto theirs =
        read_raw(dir + "/torch_losses_" + std::to_string(r) + ".bin", torch::empty({c.steps}));
    for (int s = 0; s < c.steps; ++s) {
      EXPECT_NEAR(losses[r][s], theirs[s].item<float>(), 1e-5)
          << c.name << " rank " << r << " step " << s;
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto theirs = read_raw(dir + "/torch_param_" + std::to_string(i) + ".bin", params[i]);
    EXPECT_LT((params[i] - theirs).abs().max().item<double>(), 1e-5)
        << c.name << " parameter " << i;
  }
  ASSERT_EQ(buffers[0].empty(), kind == "mlp");
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < buffers[r].size(); ++i) {
      const auto& mine = buffers[r][i];
      auto theirs = read_raw(
          dir + "/torch_rank" + std::to_string(r) + "_buffer_" + std::to_string(i) + ".bin", mine);
      EXPECT_LT((mine.to(torch::kDouble) - theirs.to(torch::kDouble)).abs().max().item<double>(),
                1e-5)
          << c.name << " rank " << r << " buffer " << i;
    }
    if (c.eval) {
      auto theirs = read_raw(dir + "/torch_eval_" + std::to_string(r) + ".bin", evals[r]);
      EXPECT_LT((evals[r] - theirs).abs().max().item<double>(), 1e-5)
          << c.name << " rank " << r << " eval output";
    }
  }
  if (kind == "cnn") {
    // Not trivially true: after training the ranks' running statistics
    // differ (each rank's own last forward updated them), so which forwards
    // broadcast shows in the buffers and in the evaluation outputs.
    EXPECT_GT(max_abs_diff(trained_buffers[0], trained_buffers[1]), 1e-4) << c.name;
  }
  // Training moved the parameters, so the comparison is not trivially true.
  EXPECT_GT(max_abs_diff(params, init), 1e-3);
  std::system(("rm -rf " + dir).c_str());
}

INSTANTIATE_TEST_SUITE_P(Ddp, PyTorchReference,
                         ::testing::Values(Case{"mlp", "mlp", kSteps, 1, false},
                                           Case{"cnn", "cnn", kSteps, 1, false},
                                           Case{"cnn_eval_after_training", "cnn", 6, 1, true},
                                           Case{"cnn_no_sync_accumulation", "cnn", 12, 3, false}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace cohort::testing::reference_test
