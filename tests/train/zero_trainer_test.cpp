// ZeRO under the Trainer: stage 1 and 2, alone (TrainerWiring::zero) and
// built from cohort DDP (TrainerWiring::ddp(ddp, zero)), next to DDP with
// LibTorch's SGD, at dp 1, 2 and 3, with and without clipping, gradient
// accumulation and a checkpoint resumed into a model drawn from another
// seed. Every step's reported norm and the parameters after the last step
// are those of one process training torch::nn::Linear layers on the whole
// batch (SGD with momentum, whose step shows a wrong gradient scale), within
// 1e-6 relative. And a loss that runs the wrapped module instead of DDP's
// forward (DDP then reduces nothing, and each rank would step on its own
// gradients) is refused on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "golden_run.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"
#include "train_fixtures.h"

namespace cohort::zero_trainer_test {
namespace {

namespace fsdp_test = cohort::testing::fsdp_test;
using fsdp_test::Named;
using torch::nn::Sequential;

constexpr int64_t kBatch = 12;  // divides by dp x accumulation (1, 2, 3 x 1, 2)
constexpr int kSteps = 3, kSaveAt = 1;
constexpr double kMaxNorm = 0.05;                           // below every step's norm
constexpr double kTinyBucketMb = 64.0 * 4 / (1024 * 1024);  // 64 floats: several buckets
const auto kSgd = torch::optim::SGDOptions(0.05).momentum(0.9);

enum class Mode { Ddp, Zero1, Zero2, Zero1Ddp, Zero2Ddp };

const char* mode_name(Mode mode) {
  const char* names[] = {"ddp", "zero1", "zero2", "zero1_over_ddp", "zero2_over_ddp"};
  return names[static_cast<int>(mode)];
}

bool over_ddp(Mode mode) {
  return mode == Mode::Ddp || mode == Mode::Zero1Ddp || mode == Mode::Zero2Ddp;
}

struct Case {
  Mode mode;
  int dp;
  bool clip;
  int accumulation;
  bool resume;
};

std::string case_text(const Case& c) {
  return std::string(mode_name(c.mode)) + "_dp" + std::to_string(c.dp) +
         (c.clip ? "_clip" : "_noclip") + "_acc" + std::to_string(c.accumulation) +
         (c.resume ? "_resume" : "");
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

using Data = testing::StepBatches;

Data make_data() { return testing::make_step_batches(kSteps, kBatch, 8, 4); }

using RankRun = testing::GoldenRun;

// One process on the whole batch, clipped by torch::nn::utils::clip_grad_norm_'s
// rule, the norm summed in float64.
RankRun reference_run(bool clip, const Data& d) {
  auto model = testing::make_mlp();
  torch::optim::SGD opt(model->parameters(), kSgd);
  RankRun ref;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    torch::mse_loss(model->forward(d.x[s]), d.y[s]).backward();
    double squares = 0;
    for (const auto& p : model->parameters()) {
      squares += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
    }
    const double norm = std::sqrt(squares), coef = kMaxNorm / (norm + 1e-6);
    EXPECT_LT(coef, 1) << "the test must exercise clipping, step " << s;
    ref.norms.push_back(norm);
    torch::NoGradGuard no_grad;
    if (clip) {
      for (auto& p : model->parameters()) p.grad().mul_(coef);
    }
    opt.step();
  }
  for (const auto& p : model->named_parameters()) {
    ref.params.insert(p.key(), p.value().detach().clone());
  }
  return ref;
}

// This rank's Trainer of `c.mode`; `through_ddp` false: the loss runs the
// wrapped model, not DDP's forward.
struct Wired {
  Sequential net;
  std::unique_ptr<DistributedDataParallel<Sequential>> ddp;
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::optional<Trainer> trainer;

  Wired(const Case& c, const std::shared_ptr<Communicator>& comm, const std::string& dir,
        uint64_t seed, bool through_ddp = true)
      : net(testing::make_mlp(seed)) {
    if (over_ddp(c.mode)) ddp = std::make_unique<DistributedDataParallel<Sequential>>(net, comm);
    ZeroOptions zo;
    zo.stage = c.mode == Mode::Zero2 || c.mode == Mode::Zero2Ddp ? 2 : 1;
    zo.bucket_cap_mb = kTinyBucketMb;
    std::optional<TrainerWiring> wiring;
    if (c.mode == Mode::Ddp) {
      sgd = std::make_unique<torch::optim::SGD>(net->parameters(), kSgd);
      wiring.emplace(TrainerWiring::ddp(*ddp, *sgd));
    } else if (ddp) {
      zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(*ddp, kSgd, zo);
      wiring.emplace(TrainerWiring::ddp(*ddp, *zero));
    } else {
      zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(net->parameters(), comm, kSgd, zo);
      wiring.emplace(TrainerWiring::zero(net.ptr(), *zero));
    }
    TrainerOptions config;
    config.max_grad_norm = c.clip ? kMaxNorm : 0.0;
    config.accumulation_steps = c.accumulation;
    if (!dir.empty()) config.checkpoint_dir = dir;
    config.progress = false;
    const bool via_ddp = ddp && through_ddp;
    LossFn loss = [this, via_ddp](const torch::data::Example<>& b) {
      return torch::mse_loss(via_ddp ? ddp->forward(b.data) : net->forward(b.data), b.target);
    };
    trainer.emplace(std::move(*wiring), loss, config);
  }
  ~Wired() {
    trainer.reset();
    zero.reset();  // before DDP, whose reduction it may hold
  }

  // This rank's rows of step s's global batch, in `accumulation` micro-batches.
  double step(const Data& d, int s, const Communicator& comm) {
    const auto x = fsdp_test::local(d.x[s], comm), y = fsdp_test::local(d.y[s], comm);
    const int64_t k = trainer->config().accumulation_steps;
    std::vector<torch::data::Example<>> micro;
    for (int64_t i = 0; i < k; ++i) micro.push_back({x.chunk(k)[i], y.chunk(k)[i]});
    return trainer->train_step(micro).grad_norm;
  }
};

class ZeroTrainer : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroTrainer, MatchesOneProcessOnTheWholeBatch) {
  const Case c = GetParam();
  const auto data = make_data();
  const RankRun ref = reference_run(c.clip, data);
  testing::TempDir dir("cohort-zero-trainer");
  std::mutex mu;
  std::map<int, RankRun> runs;
  testing::run_ranks_shared(c.dp, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    RankRun run;
    auto w = std::make_unique<Wired>(c, comm, c.resume ? dir.path() : "", 7);
    for (int s = 0; s < kSteps; ++s) {
      if (c.resume && s == kSaveAt) {
        w->trainer->save_checkpoint();
        // Other initial weights: only the checkpoint makes it the same model.
        w.reset();
        w = std::make_unique<Wired>(c, comm, dir.path(), 100);
        EXPECT_EQ(w->trainer->resume(), std::optional<int64_t>(kSaveAt)) << comm->rank();
      }
      run.norms.push_back(w->step(data, s, *comm));
    }
    for (const auto& p : w->net->named_parameters()) {
      run.params.insert(p.key(), p.value().detach().clone());
    }
    std::lock_guard<std::mutex> lock(mu);
    runs[comm->rank()] = std::move(run);
  });
  testing::expect_golden(runs, ref, c.dp, kSteps);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Mode mode : {Mode::Ddp, Mode::Zero1, Mode::Zero2, Mode::Zero1Ddp, Mode::Zero2Ddp}) {
    for (int dp : {1, 2, 3}) {
      for (bool clip : {true, false}) {
        for (int accumulation : {1, 2}) out.push_back({mode, dp, clip, accumulation, false});
      }
      out.push_back({mode, dp, true, 2, true});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, ZeroTrainer, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

class LossAroundDdp : public ::testing::TestWithParam<Case> {};

// The loss runs the module DDP wraps: DDP reduces nothing. Before the
// Trainer checked, each rank clipped and stepped by its own gradients (ZeRO
// stage 1 all-gathered a mix of them): a norm other than one process's.
TEST_P(LossAroundDdp, IsRefusedOnEveryRank) {
  const Case c = GetParam();
  const auto data = make_data();
  const RankRun ref = reference_run(c.clip, data);
  std::mutex mu;
  std::map<int, std::string> errors;
  testing::run_ranks_shared(c.dp, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    Wired w(c, comm, "", 7, /*through_ddp=*/false);
    std::string error;
    try {
      const double norm = w.step(data, 0, *comm);
      error =
          "trained: norm " + std::to_string(norm) + ", one process " + std::to_string(ref.norms[0]);
    } catch (const InvalidArgument& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    errors[comm->rank()] = error;
  });
  ASSERT_EQ(errors.size(), static_cast<size_t>(c.dp));
  for (const auto& [rank, error] : errors) {
    EXPECT_NE(error.find("on rank " + std::to_string(rank)), std::string::npos)
        << "rank " << rank << ": " << error;
    EXPECT_NE(error.find("reduced no gradients"), std::string::npos)
        << "rank " << rank << ": " << error;
  }
}

std::vector<Case> around_cases() {
  std::vector<Case> out;
  for (Mode mode : {Mode::Ddp, Mode::Zero1Ddp, Mode::Zero2Ddp}) {
    for (int dp : {1, 2, 3}) {
      for (int accumulation : {1, 2}) out.push_back({mode, dp, true, accumulation, false});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, LossAroundDdp, ::testing::ValuesIn(around_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

}  // namespace
}  // namespace cohort::zero_trainer_test
