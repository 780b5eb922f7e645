// The Trainer over a model of tensor-parallel layers without a mesh: FSDP ×
// TP (docs/usage.md), DDP and the all-reduce wiring, each over the TP rank's
// data-parallel group (one Trainer per TP rank), ranks as threads at
// dp × tp = 1×1, 1×2, 2×2 and 3×2. With clipping on every step, each rank
// reports the global gradient norm of one process (tp = 1, the whole
// batch) within 1e-6 relative, the parameters replicated over TP (the
// row-parallel biases, the head) stay bitwise equal across each TP group,
// and after three SGD steps every rank holds its slices of the one-process
// model within 1e-6 relative. fit() refuses, on every rank, TP ranks that
// draw other samples or other inputs, and the metrics file gets one line
// per step (TP rank 0's).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/rank_errors.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"
#include "tests/fsdp/fsdp_tp_model.h"
#include "train_fixtures.h"

namespace cohort::tensor_parallel_trainer_test {
namespace {

using namespace cohort::testing::fsdp_tp;
namespace fsdp_test = cohort::testing::fsdp_test;
using fsdp_test::Named;

constexpr int kSteps = 3;
constexpr int64_t kBatch = 12;  // divides by 1, 2 and 3
constexpr double kLr = 0.05, kMaxNorm = 0.05;

enum class Mode { Fsdp, Ddp, AllReduce };

struct Case {
  Mode mode;
  int dp, tp;
};

std::string mode_name(Mode mode) {
  const char* modes[] = {"fsdp", "ddp", "all_reduce"};
  return modes[static_cast<int>(mode)];
}

std::string case_text(const Case& c) {
  return mode_name(c.mode) + "_dp" + std::to_string(c.dp) + "_tp" + std::to_string(c.tp);
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

using Data = testing::StepBatches;

Data make_data() { return testing::make_step_batches(kSteps, kBatch, kWidth, kWidth); }

struct RankRun {
  std::vector<double> norms;
  std::vector<bool> clipped;
  Named params;  // this rank's TP slices (FSDP: gathered over dp)
};

// One process, tp = 1, the whole batch: SGD clipped by
// torch::nn::utils::clip_grad_norm_'s rule, the norm summed in float64.
RankRun reference_run(const Data& d) {
  RankRun ref;
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_tp_model(comm, nullptr, {});
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(d.x[s]), d.y[s]).backward();
      double squares = 0;
      for (const auto& p : model->parameters()) {
        squares += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
      }
      const double norm = std::sqrt(squares), coef = kMaxNorm / (norm + 1e-6);
      ref.norms.push_back(norm);
      ref.clipped.push_back(coef < 1);
      torch::NoGradGuard no_grad;
      if (coef < 1) {
        for (auto& p : model->parameters()) p.grad().mul_(coef);
      }
      opt.step();
    }
    for (const auto& p : model->named_parameters()) {
      ref.params.insert(p.key(), p.value().detach().clone());
    }
  });
  return ref;
}

// The Trainer of `mode` over this rank's TP model (every part it needs kept alive).
struct Wired {
  torch::nn::Sequential seq{nullptr};
  FullyShard root{nullptr};
  std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
  std::unique_ptr<torch::optim::SGD> opt;
  std::optional<Trainer> trainer;

  Wired(Mode mode, const DeviceMesh& mesh, TrainerOptions config) {
    const auto dp = mesh["dp"].process_group(), tp = mesh["tp"].process_group();
    seq = make_tp_model(tp, mode == Mode::Fsdp ? dp : nullptr, {});
    const auto sgd = torch::optim::SGDOptions(kLr);
    std::optional<TrainerWiring> wiring;
    LossFn loss;
    if (mode == Mode::Fsdp) {
      root = fully_shard(seq, dp);
      opt = std::make_unique<torch::optim::SGD>(root->parameters(), sgd);
      wiring.emplace(TrainerWiring::fsdp(root, *opt));
      loss = [this](const torch::data::Example<>& b) {
        return torch::mse_loss(root->forward(b.data), b.target);
      };
    } else if (mode == Mode::Ddp) {
      ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(seq, dp);
      opt = std::make_unique<torch::optim::SGD>(seq->parameters(), sgd);
      wiring.emplace(TrainerWiring::ddp(*ddp, *opt));
      loss = [this](const torch::data::Example<>& b) {
        return torch::mse_loss(ddp->forward(b.data), b.target);
      };
    } else {
      opt = std::make_unique<torch::optim::SGD>(seq->parameters(), sgd);
      wiring.emplace(TrainerWiring::all_reduce(seq.ptr(), *opt, dp));
      loss = [this](const torch::data::Example<>& b) {
        return torch::mse_loss(seq->forward(b.data), b.target);
      };
    }
    config.progress = false;
    trainer.emplace(std::move(*wiring), loss, config);
  }

  // This rank's TP slices, whole over dp.
  Named params() {
    if (!root.is_empty()) return root->full_state_dict();
    Named out;
    for (const auto& p : seq->named_parameters()) out.insert(p.key(), p.value().detach().clone());
    return out;
  }
};

class TensorParallelTrainer : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelTrainer, ClipsByTheOneProcessNormAndKeepsReplicasEqual) {
  const Case c = GetParam();
  const auto data = make_data();
  const RankRun ref = reference_run(data);
  std::mutex mu;
  std::map<std::pair<int, int>, RankRun> runs;  // (dp rank, tp rank) -> its run
  testing::run_ranks_shared(c.dp * c.tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {c.dp, c.tp}, {"dp", "tp"});
    TrainerOptions config;
    config.max_grad_norm = kMaxNorm;
    Wired w(c.mode, mesh, config);
    const auto& dp = *mesh["dp"].process_group();
    RankRun run;
    for (int s = 0; s < kSteps; ++s) {
      const auto m = w.trainer->train_step(
          {{fsdp_test::local(data.x[s], dp), fsdp_test::local(data.y[s], dp)}});
      run.norms.push_back(m.grad_norm);
      run.clipped.push_back(m.clipped);
    }
    run.params = w.params();
    std::lock_guard<std::mutex> lock(mu);
    runs[{mesh.local_rank("dp"), mesh.local_rank("tp")}] = std::move(run);
  });
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.dp * c.tp));
  for (const auto& [at, run] : runs) {
    const auto [d, t] = at;
    const std::string rank = "dp rank " + std::to_string(d) + ", tp rank " + std::to_string(t);
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_TRUE(ref.clipped[s]) << "the test must exercise clipping";
      EXPECT_NEAR(run.norms[s], ref.norms[s], 1e-6 * ref.norms[s]) << rank << ", step " << s;
      EXPECT_TRUE(run.clipped[s]) << rank << ", step " << s;
    }
    const auto& first = runs.at({d, 0}).params;
    for (const auto& p : run.params) {
      if (!replicated_over_tp(p.key())) continue;
      EXPECT_TRUE(torch::equal(p.value(), first[p.key()]))
          << rank << ": '" << p.key() << "' differs from TP rank 0's by "
          << (p.value() - first[p.key()]).abs().max().item<double>();
    }
    Named want;
    for (const auto& e : ref.params) want.insert(e.key(), tp_slice(e.key(), e.value(), t, c.tp));
    fsdp_test::expect_close(run.params, want, 1e-6, rank);
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Mode mode : {Mode::Fsdp, Mode::Ddp, Mode::AllReduce}) {
    for (const auto& [dp, tp] : std::vector<std::pair<int, int>>{{1, 1}, {1, 2}, {2, 2}, {3, 2}}) {
      out.push_back({mode, dp, tp});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, TensorParallelTrainer, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

// The data-parallel rank's micro-batches; `other` draws other inputs
// (targets alike) or other samples altogether.
class Batches : public DataSource {
 public:
  enum Other { kNone, kInputs, kSamples };
  Batches(int dp_rank, Other other) : dp_rank_(dp_rank), other_(other) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return 2; }
  torch::data::Example<> batch(int64_t index) override {
    auto gen = testing::make_generator(100 + 10 * dp_rank_ + index + (other_ == kSamples) * 1000);
    auto x = torch::randn({4, kWidth}, gen), y = torch::randn({4, kWidth}, gen);
    if (other_ == kInputs) x = x + 1;
    return {x, y};
  }

 private:
  int dp_rank_;
  Other other_;
};

class TensorParallelData : public ::testing::TestWithParam<Mode> {};

// TP rank 1 of data-parallel rank 0 at dp 2 × tp 2: every rank refuses.
TEST_P(TensorParallelData, TensorParallelRanksMustDrawTheSameSamplesAndInputs) {
  for (auto other : {Batches::kInputs, Batches::kSamples}) {
    const auto errors = testing::errors_on_every_rank(4, [&](std::shared_ptr<Communicator> world) {
      torch::set_num_threads(1);
      auto mesh = init_device_mesh(world, {2, 2}, {"dp", "tp"});
      Wired w(GetParam(), mesh, {});
      const int d = mesh.local_rank("dp"), t = mesh.local_rank("tp");
      Batches source(d, d == 0 && t == 1 ? other : Batches::kNone);
      w.trainer->fit(source);
    });
    const std::string what = other == Batches::kInputs ? "the inputs" : "the samples";
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_NE(errors[r].find(what), std::string::npos) << "rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find("tensor-parallel group"), std::string::npos) << errors[r];
    }
  }
}

// One line per step: TP rank 1's rank 0 writes none.
TEST_P(TensorParallelData, TensorParallelRankZeroAloneWritesTheMetrics) {
  testing::TempDir dir("cohort-tp-metrics");
  const auto path = dir / "metrics.jsonl";
  testing::run_ranks_shared(4, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {2, 2}, {"dp", "tp"});
    TrainerOptions config;
    config.metrics_path = path;
    Wired w(GetParam(), mesh, config);
    Batches source(mesh.local_rank("dp"), Batches::kNone);
    w.trainer->fit(source);
  });
  std::ifstream in(path);
  int lines = 0;
  for (std::string line; std::getline(in, line);) lines += line.find("\"train\"") != line.npos;
  EXPECT_EQ(lines, 2);
}

INSTANTIATE_TEST_SUITE_P(Trainer, TensorParallelData,
                         ::testing::Values(Mode::Fsdp, Mode::Ddp, Mode::AllReduce),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return mode_name(info.param);
                         });

}  // namespace
}  // namespace cohort::tensor_parallel_trainer_test
