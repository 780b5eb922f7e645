// A model whose Linear is used twice (a tied weight: LibTorch's
// parameters() lists it twice, PyTorch's once) trains as plain LibTorch in
// one process does with torch::nn::utils::clip_grad_norm_ over each unique
// parameter once: the norm counts the tied weight once and clipping scales
// it once. DDP and the all-reduce sync, Gloo (and UCX), worlds 1 and 3; the
// fused optimizer, whose AdamW state of the tied weight every name holds
// (checkpoint and resume); and a pipeline whose two function stages on one
// rank share a tensor.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <optional>

#include "cohort/core/torch_compat.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::tied_parameters_test {
namespace {

using cohort::testing::make_data;
using cohort::testing::make_generator;

constexpr int64_t kMicro = 4, kSteps = 3;

// Each tensor once, in order (what PyTorch's parameters() gives).
std::vector<torch::Tensor> each_once(const std::vector<torch::Tensor>& all) {
  std::vector<torch::Tensor> out;
  for (const auto& p : all) {
    bool seen = false;
    for (const auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}
constexpr double kLr = 0.1;

// Linear(8, 8) tanh (the same Linear) tanh Linear(8, 4).
torch::nn::Sequential make_tied() {
  torch::nn::Linear shared(8, 8), head(8, 4);
  torch::nn::Sequential net(shared, torch::nn::Tanh(), shared, torch::nn::Tanh(), head);
  auto gen = make_generator(5);
  torch::NoGradGuard no_grad;
  for (auto& p : each_once(net->parameters())) {
    p.copy_(torch::randn(p.sizes(), gen, torch::kFloat32) * 0.4);
  }
  return net;
}

struct Case {
  std::string backend;
  int world;
  bool ddp;
  double max_norm;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return c.backend + "_world" + std::to_string(c.world) + (c.ddp ? "_ddp" : "_allreduce") +
         (c.max_norm > 0 ? "_clip" : "");
}

std::vector<Case> cases() {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<Case> out;
  for (const auto& b : backends)
    for (int w : {1, 3})
      for (bool ddp : {true, false}) out.push_back({b, w, ddp, 0.05});
  out.push_back({"gloo", 3, true, 0.0});
  return out;
}

class TiedParameters : public ::testing::TestWithParam<Case> {};

TEST_P(TiedParameters, NormAndClippingCountEachTensorOnce) {
  const Case c = GetParam();
  const int64_t global = c.world * kMicro;
  const auto data = make_data(kSteps * global);
  // One process, plain LibTorch, over the unique parameters.
  std::vector<torch::Tensor> ref_params;
  std::vector<double> ref_norms;
  {
    auto net = make_tied();
    const auto unique = each_once(net->parameters());
    ASSERT_EQ(unique.size(), 4u);
    torch::optim::SGD opt(unique, kLr);
    for (int64_t s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(data.x.narrow(0, s * global, global)),
                                           data.y.narrow(0, s * global, global))
          .backward();
      ref_norms.push_back(
          torch::nn::utils::clip_grad_norm_(unique, c.max_norm > 0 ? c.max_norm : 1e30));
      opt.step();
    }
    for (const auto& p : unique) ref_params.push_back(p.detach().clone());
  }
  testing::ThreadRanksOptions options;
  options.backend = c.backend;
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = make_tied();
        const auto unique = each_once(net->parameters());
        torch::optim::SGD opt(unique, kLr);
        TrainerOptions config;
        config.max_grad_norm = c.max_norm;
        config.schedule.base_lr = kLr;
        config.progress = false;
        std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
        std::optional<TrainerWiring> wiring;
        if (c.ddp) {
          ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm);
          wiring.emplace(TrainerWiring::ddp(*ddp, opt));
        } else {
          wiring.emplace(TrainerWiring::all_reduce(net.ptr(), opt, comm));
        }
        auto loss = [&](const torch::data::Example<>& b) {
          auto out = ddp ? ddp->forward(b.data) : net->forward(b.data);
          return torch::nn::functional::cross_entropy(out, b.target);
        };
        Trainer trainer(std::move(*wiring), loss, config);
        for (int64_t s = 0; s < kSteps; ++s) {
          const int64_t start = s * global + comm->rank() * kMicro;
          const auto m = trainer.train_step(
              {{data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}});
          EXPECT_NEAR(m.grad_norm, ref_norms[s], 1e-5 * ref_norms[s]) << "step " << s;
          if (c.max_norm > 0) {
            EXPECT_TRUE(m.clipped) << "the test must exercise clipping";
          }
        }
        for (size_t i = 0; i < unique.size(); ++i) {
          EXPECT_TRUE(torch::allclose(unique[i], ref_params[i], 1e-5, 1e-6))
              << "parameter " << i << " on rank " << comm->rank() << " differs by "
              << (unique[i] - ref_params[i]).abs().max().item<float>();
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Trainer, TiedParameters, ::testing::ValuesIn(cases()), name_of);

// The fused optimizer over the tied model: AdamW over the unique parameters
// in one process, clipped or not. The tied weight is stepped once, with the
// gradient the Trainer clipped, and both its names (0.weight, 2.weight) hold
// that one state: in param_state, in the checkpoint, and after resuming into
// the fused optimizer or into DDP + AdamW.
struct FusedCase {
  int world;
  double max_norm;
};

std::string fused_name(const ::testing::TestParamInfo<FusedCase>& info) {
  return "world" + std::to_string(info.param.world) + (info.param.max_norm > 0 ? "_clip" : "");
}

constexpr double kAdamLr = 0.01;
const std::vector<std::string> kTiedNames = {"0.weight", "2.weight"};

const torch::optim::AdamWParamState& adamw_state(torch::optim::Optimizer& opt,
                                                 const torch::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(
      *opt.state().at(cohort::optimizer_state_key(p)));
}

// Within rounding of `want` (relative to its largest element).
void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  const double scale = want.abs().max().item<double>();
  const double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4 * scale + 1e-9)
      << what << " differs by " << diff << " (reference max " << scale << ")";
}

class TiedFused : public ::testing::TestWithParam<FusedCase> {};

TEST_P(TiedFused, TiedWeightStepsOnceAndEveryNameHoldsItsState) {
  const FusedCase c = GetParam();
  const int64_t global = c.world * kMicro;
  const auto data = make_data((kSteps + 1) * global);
  auto batch = [&](int64_t s, int rank) {
    const int64_t start = s * global + rank * kMicro;
    return std::vector<torch::data::Example<>>{
        {data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}};
  };
  // One process: AdamW over the unique parameters, kSteps + 1 steps.
  std::vector<double> ref_norms;
  torch::Tensor ref_m, ref_v;  // the tied weight's state after kSteps
  std::vector<torch::Tensor> ref_params;
  {
    auto net = make_tied();
    const auto unique = each_once(net->parameters());
    torch::optim::AdamW opt(unique, torch::optim::AdamWOptions(kAdamLr));
    for (int64_t s = 0; s <= kSteps; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(data.x.narrow(0, s * global, global)),
                                           data.y.narrow(0, s * global, global))
          .backward();
      ref_norms.push_back(
          torch::nn::utils::clip_grad_norm_(unique, c.max_norm > 0 ? c.max_norm : 1e30));
      opt.step();
      if (s == kSteps - 1) {
        ref_m = adamw_state(opt, unique[0]).exp_avg().clone();
        ref_v = adamw_state(opt, unique[0]).exp_avg_sq().clone();
      }
    }
    for (const auto& p : unique) ref_params.push_back(p.detach().clone());
  }
  auto expect_params = [&](const std::vector<torch::Tensor>& unique, const std::string& where) {
    ASSERT_EQ(unique.size(), ref_params.size());
    for (size_t i = 0; i < unique.size(); ++i) {
      expect_close(unique[i], ref_params[i], where + ": parameter " + std::to_string(i));
    }
  };
  cohort::testing::TempDir dir("cohort-tied-fused");
  TrainerOptions config;
  config.max_grad_norm = c.max_norm;
  config.progress = false;
  config.checkpoint_dir = dir / "trainer";
  auto fused_trainer = [&](torch::nn::Sequential& net, FusedDistributedOptimizer& fused) {
    auto loss = [&net](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
    };
    return Trainer(TrainerWiring::fused(net.ptr(), fused), loss, config);
  };
  auto expect_fused_state = [&](FusedDistributedOptimizer& fused, const std::string& where) {
    for (size_t i : {0, 2}) {
      const auto st = fused.param_state(i);
      EXPECT_EQ(st.step, kSteps) << where << ": " << kTiedNames[i / 2];
      expect_close(st.exp_avg, ref_m, where + ": " + kTiedNames[i / 2] + " exp_avg");
      expect_close(st.exp_avg_sq, ref_v, where + ": " + kTiedNames[i / 2] + " exp_avg_sq");
    }
  };
  testing::run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_tied();
    FusedDistributedOptimizer fused(net->parameters(), comm, torch::optim::AdamWOptions(kAdamLr));
    int64_t bytes = 0;
    for (const auto& p : each_once(net->parameters())) bytes += p.nbytes();
    EXPECT_EQ(fused.grad_bytes(), bytes) << "the buckets hold the tied weight once";
    auto trainer = fused_trainer(net, fused);
    for (int64_t s = 0; s < kSteps; ++s) {
      const auto m = trainer.train_step(batch(s, comm->rank()));
      EXPECT_NEAR(m.grad_norm, ref_norms[s], 1e-5 * ref_norms[s]) << "step " << s;
      EXPECT_EQ(m.clipped, c.max_norm > 0) << "step " << s;
    }
    expect_fused_state(fused, "fused rank " + std::to_string(comm->rank()));
    trainer.save_checkpoint();
    dcp::save(dcp::get_state_dict(*net, fused), dir / "dcp", *comm);
  });
  // A checkpoint reader gets the state under either name.
  const auto meta = dcp::read_metadata(dir / "dcp");
  for (const auto& name : kTiedNames) {
    expect_close(dcp::read_tensor(dir / "dcp", meta, "optim." + name + ".exp_avg"), ref_m,
                 "checkpoint optim." + name + ".exp_avg");
    expect_close(dcp::read_tensor(dir / "dcp", meta, "optim." + name + ".exp_avg_sq"), ref_v,
                 "checkpoint optim." + name + ".exp_avg_sq");
  }
  // Resumed into the fused optimizer, one more step.
  testing::run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_tied();
    FusedDistributedOptimizer fused(net->parameters(), comm, torch::optim::AdamWOptions(kAdamLr));
    auto trainer = fused_trainer(net, fused);
    ASSERT_EQ(trainer.resume().value_or(-1), kSteps);
    const auto where = "resumed fused rank " + std::to_string(comm->rank());
    expect_fused_state(fused, where);
    trainer.train_step(batch(kSteps, comm->rank()));
    expect_params(each_once(net->parameters()), where);
  });
  // Resumed into DDP + AdamW over the unique parameters, one more step.
  testing::run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_tied();
    const auto unique = each_once(net->parameters());
    torch::optim::AdamW opt(unique, torch::optim::AdamWOptions(kAdamLr));
    DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
    auto loss = [&](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(ddp->forward(b.data), b.target);
    };
    Trainer trainer(TrainerWiring::ddp(ddp, opt), loss, config);
    ASSERT_EQ(trainer.resume().value_or(-1), kSteps);
    const auto where = "resumed DDP rank " + std::to_string(comm->rank());
    expect_close(adamw_state(opt, unique[0]).exp_avg(), ref_m, where + ": exp_avg");
    trainer.train_step(batch(kSteps, comm->rank()));
    expect_params(unique, where);
  });
}

INSTANTIATE_TEST_SUITE_P(Trainer, TiedFused,
                         ::testing::Values(FusedCase{1, 0.05}, FusedCase{3, 0.05},
                                           FusedCase{1, 0.0}, FusedCase{3, 0.0}),
                         fused_name);

// Two function stages on one rank (interleaved, pp 1, v 2) share a tensor:
// the wiring's model holds it once, and the Trainer clips as one process.
TEST(TiedParametersPipeline, SharedTensorOfTwoFunctionStagesCountsOnce) {
  constexpr int64_t kWidth = 6, m = 2;
  auto gen = make_generator(3);
  const auto w0 = torch::randn({kWidth, kWidth}, gen) * 0.5;
  const auto x = torch::randn({2 * m, kWidth}, gen), y = torch::randn({2 * m, kWidth}, gen);
  const double max_norm = 0.01;
  torch::Tensor ref;
  double ref_norm = 0;
  {
    auto w = w0.clone().requires_grad_(true);
    torch::nn::functional::mse_loss(torch::tanh(torch::tanh(x.matmul(w)).matmul(w)), y).backward();
    ref_norm = torch::nn::utils::clip_grad_norm_({w}, max_norm);
    torch::NoGradGuard no_grad;
    ref = w - kLr * w.grad();
  }
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto w = w0.clone().requires_grad_(true);
    auto fn = [w](const pipeline::Tensors& in) {
      return pipeline::Tensors{torch::tanh(in[0].matmul(w))};
    };
    std::vector<pipeline::PipelineStage> stages;
    stages.emplace_back(0, fn, std::vector<torch::Tensor>{w});
    stages.emplace_back(1, fn, std::vector<torch::Tensor>{w});
    auto mse = [](const pipeline::Tensors& out, const pipeline::Tensors& target) {
      return torch::nn::functional::mse_loss(out[0], target[0]);
    };
    pipeline::PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), std::move(stages),
                                 pipeline::make_schedule("interleaved", 1, 2, m), mse);
    torch::optim::SGD opt(rt.parameters(), kLr);
    auto wiring = TrainerWiring::pipeline(rt, opt);
    EXPECT_EQ(wiring.model()->parameters().size(), 1u);
    TrainerOptions config;
    config.accumulation_steps = m;
    config.max_grad_norm = max_norm;
    config.schedule.base_lr = kLr;
    config.progress = false;
    Trainer trainer(std::move(wiring), config);
    const auto metrics = trainer.train_step(
        {{x.narrow(0, 0, 2), y.narrow(0, 0, 2)}, {x.narrow(0, 2, 2), y.narrow(0, 2, 2)}});
    EXPECT_NEAR(metrics.grad_norm, ref_norm, 1e-5 * ref_norm);
    EXPECT_TRUE(metrics.clipped);
    EXPECT_TRUE(torch::allclose(w, ref, 1e-5, 1e-6))
        << "differs by " << (w - ref).abs().max().item<float>();
  });
}

}  // namespace
}  // namespace cohort::tied_parameters_test
