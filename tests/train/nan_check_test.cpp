// A NaN or Inf in one rank's loss or gradients at step k (TrainerOptions::
// check_for_nan_in_loss_and_grad, on by default): every rank throws NonFiniteError before its
// optimizer step and keeps the parameters of step k - 1 bitwise, and the optimizer state too (a
// good step after it gives the bits of a run that never saw step k); with the option off every
// rank steps on them, as before the check.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::nan_check_test {
namespace {

using cohort::testing::make_data;
using cohort::testing::make_mlp;

constexpr int64_t kMicro = 4;
constexpr int64_t kAccumulation = 2;
constexpr int kBad = 2;  // the step (0-based) whose first micro-batch is bad on the last rank
const auto kAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

// LossOnly: a NaN added to the loss, gradients finite. Input: a NaN in a sample, so loss and
// gradients. Gradient: an Inf in the output's gradient (a hook), the loss finite.
enum class Inject { LossOnly, Input, Gradient };
enum class Mode { Ddp, Zero2, Fsdp, Pipeline };

struct Case {
  std::string backend;
  int world;
  Mode mode;
  Inject inject;
  bool check;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* mode[] = {"ddp", "zero2", "fsdp", "pipeline"};
  const char* inject[] = {"loss", "input", "grad"};
  return c.backend + "_world" + std::to_string(c.world) + "_" + mode[static_cast<int>(c.mode)] +
         "_" + inject[static_cast<int>(c.inject)] + (c.check ? "" : "_unchecked");
}

std::vector<Case> cases() {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<Case> out;
  for (const auto& b : backends)
    for (int w : {1, 2, 3})
      for (Inject i : {Inject::LossOnly, Inject::Input, Inject::Gradient}) {
        out.push_back({b, w, Mode::Ddp, i, true});
      }
  for (Mode m : {Mode::Zero2, Mode::Fsdp, Mode::Pipeline})
    for (int w : {1, 3})
      for (Inject i : {Inject::LossOnly, Inject::Gradient}) out.push_back({"gloo", w, m, i, true});
  for (Inject i : {Inject::LossOnly, Inject::Input, Inject::Gradient}) {
    out.push_back({"gloo", 3, Mode::Ddp, i, false});
  }
  return out;
}

// One rank's parameters (its shard under ZeRO-2's model copy and FSDP), cloned.
std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

int64_t non_finite(const std::vector<torch::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += (~torch::isfinite(p)).sum().item<int64_t>();
  return n;
}

struct RankResult {
  std::vector<torch::Tensor> before;  // after step kBad - 1
  std::vector<torch::Tensor> after;   // after step kBad (or its exception)
  std::vector<torch::Tensor> next;    // after one more good step
  std::optional<std::string> error;   // NonFiniteError's text
  double loss = 0;                    // step kBad's reported loss when it did not throw
};

// Runs `step` for steps 0 .. kBad - 1, step kBad with `poison` set on the last rank unless
// `skip_bad`, then step kBad + 1; `params` reads this rank's parameters.
RankResult steps(bool skip_bad, bool bad_rank, bool& poison,
                 const std::function<StepMetrics(int)>& step,
                 const std::function<std::vector<torch::Tensor>()>& params) {
  RankResult r;
  for (int s = 0; s < kBad; ++s) step(s);
  r.before = snapshot(params());
  if (!skip_bad) {
    poison = bad_rank;
    try {
      r.loss = step(kBad).loss;
    } catch (const NonFiniteError& e) {
      r.error = e.what();
    }
  }
  r.after = snapshot(params());
  step(kBad + 1);
  r.next = snapshot(params());
  return r;
}

// A pipeline of one Linear(8, 8) Tanh stage per rank, regressing x on itself; the last stage's
// loss (on the last rank) is the bad one.
RankResult train_pipeline(const Case& c, const testing::Synthetic& data, bool skip_bad,
                          std::shared_ptr<Communicator> comm) {
  torch::set_num_threads(1);
  torch::nn::Sequential model;
  for (int s = 0; s < c.world; ++s) {
    model->push_back(torch::nn::Linear(8, 8));
    model->push_back(torch::nn::Tanh());
  }
  testing::fill_alike(*model);
  std::vector<int64_t> boundaries;
  for (int s = 1; s < c.world; ++s) boundaries.push_back(2 * s);
  bool poison = false;
  auto loss_fn = [&](const pipeline::Tensors& out, const pipeline::Tensors& t) {
    const bool bad = poison;
    poison = false;
    if (bad && c.inject == Inject::Gradient) {
      out[0].register_hook([](torch::Tensor g) {
        auto h = g.clone();
        h.view(-1)[0] = std::numeric_limits<float>::infinity();
        return h;
      });
    }
    auto loss = torch::nn::functional::mse_loss(out[0], t[0]);
    if (bad && c.inject == Inject::LossOnly) loss = loss + std::numeric_limits<double>::quiet_NaN();
    return loss;
  };
  pipeline::PipelineRuntime rt(
      DeviceMesh::from_group(comm, "pp"),
      {pipeline::PipelineStage(comm->rank(),
                               pipeline::split_sequential(model, boundaries, comm->rank()))},
      pipeline::Schedule1F1B(c.world, static_cast<int>(kAccumulation)), loss_fn);
  torch::optim::AdamW adamw(rt.parameters(), kAdamW);
  TrainerOptions config;
  config.accumulation_steps = kAccumulation;
  config.progress = false;
  config.check_for_nan_in_loss_and_grad = c.check;
  Trainer trainer(TrainerWiring::pipeline(rt, adamw), config);
  auto step = [&](int s) {
    std::vector<torch::data::Example<>> batches;
    for (int64_t i = 0; i < kAccumulation; ++i) {
      const auto x = data.x.narrow(0, (s * kAccumulation + i) * kMicro, kMicro);
      batches.push_back({x, x});
    }
    return trainer.train_step(batches);
  };
  return steps(skip_bad, comm->rank() == c.world - 1, poison, step,
               [&] { return rt.parameters(); });
}

// DDP, ZeRO-2 or FSDP over make_mlp, classifying; the last rank's first micro-batch of step
// kBad is the bad one. `skip_bad`: the reference, which never runs step kBad.
RankResult train(const Case& c, const testing::Synthetic& data, bool skip_bad,
                 std::shared_ptr<Communicator> comm) {
  torch::set_num_threads(1);
  if (c.mode == Mode::Pipeline) return train_pipeline(c, data, skip_bad, comm);
  auto net = make_mlp();
  std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::optional<DeviceMesh> mesh;
  std::optional<FullyShard> fsdp;
  std::unique_ptr<torch::optim::AdamW> adamw;
  std::optional<TrainerWiring> wiring;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<std::vector<torch::Tensor>()> params;
  switch (c.mode) {
    case Mode::Ddp:
      ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm);
      adamw = std::make_unique<torch::optim::AdamW>(ddp->parameters(), kAdamW);
      wiring.emplace(TrainerWiring::ddp(*ddp, *adamw));
      forward = [&](const torch::Tensor& x) { return ddp->forward(x); };
      params = [&] { return net->parameters(); };
      break;
    case Mode::Zero2: {
      ZeroOptions zo;
      zo.stage = 2;
      zero =
          ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW, zo);
      wiring.emplace(TrainerWiring::zero(net.ptr(), *zero));
      forward = [&](const torch::Tensor& x) { return net->forward(x); };
      params = [&] { return net->parameters(); };
      break;
    }
    case Mode::Fsdp:
      mesh.emplace(DeviceMesh::from_group(comm, "shard"));
      fsdp.emplace(fully_shard(net, *mesh));
      adamw = std::make_unique<torch::optim::AdamW>((*fsdp)->parameters(), kAdamW);
      wiring.emplace(TrainerWiring::fsdp(*fsdp, *adamw));
      forward = [&](const torch::Tensor& x) { return (*fsdp)->forward(x); };
      params = [&] { return (*fsdp)->parameters(); };
      break;
    case Mode::Pipeline:  // train_pipeline
      break;
  }
  TrainerOptions config;
  config.accumulation_steps = kAccumulation;
  config.progress = false;
  config.check_for_nan_in_loss_and_grad = c.check;
  const bool bad_rank = comm->rank() == c.world - 1;
  bool poison = false;  // the next micro-batch is the bad one
  LossFn loss_fn = [&](const torch::data::Example<>& b) {
    const bool bad = poison;
    poison = false;
    auto x = b.data;
    if (bad && c.inject == Inject::Input) {
      x = x.clone();
      x[0][0] = std::numeric_limits<float>::quiet_NaN();
    }
    auto y = forward(x);
    if (bad && c.inject == Inject::Gradient) {
      y.register_hook([](torch::Tensor g) {
        auto h = g.clone();
        h.view(-1)[0] = std::numeric_limits<float>::infinity();
        return h;
      });
    }
    auto loss = torch::nn::functional::cross_entropy(y, b.target);
    if (bad && c.inject == Inject::LossOnly) loss = loss + std::numeric_limits<double>::quiet_NaN();
    return loss;
  };
  Trainer trainer(std::move(*wiring), loss_fn, config);
  const int64_t global = c.world * kAccumulation * kMicro;
  auto step = [&](int s) {
    std::vector<torch::data::Example<>> batches;
    for (int64_t i = 0; i < kAccumulation; ++i) {
      const int64_t start = s * global + (comm->rank() * kAccumulation + i) * kMicro;
      batches.push_back({data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)});
    }
    return trainer.train_step(batches);
  };
  return steps(skip_bad, bad_rank, poison, step, params);
}

std::map<int, RankResult> run(const Case& c, const testing::Synthetic& data, bool skip_bad) {
  testing::ThreadRanksOptions options;
  options.backend = c.backend;
  return testing::results_of_ranks<RankResult>(
      c.world, [&](std::shared_ptr<Communicator> comm) { return train(c, data, skip_bad, comm); },
      options);
}

class NanCheck : public ::testing::TestWithParam<Case> {};

TEST_P(NanCheck, OneRanksNonFiniteLossOrGradientStopsEveryRank) {
  const Case c = GetParam();
  const auto data = make_data((kBad + 2) * c.world * kAccumulation * kMicro);
  const auto got = run(c, data, false);
  ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
  for (const auto& [rank, r] : got) {
    const int64_t bad_elements = non_finite(r.after);
    const bool stepped = !bitwise_equal(r.after, r.before);
    std::printf("rank %d: threw %d, stepped %d, non-finite parameter elements %lld, loss %g\n",
                rank, r.error ? 1 : 0, stepped ? 1 : 0, static_cast<long long>(bad_elements),
                r.loss);
    if (!c.check) {
      // Unchecked: the step is taken on every rank, and a non-finite gradient reaches every
      // rank's parameters.
      EXPECT_FALSE(r.error) << "rank " << rank;
      EXPECT_TRUE(stepped) << "rank " << rank;
      EXPECT_EQ(std::isnan(r.loss), c.inject != Inject::Gradient) << "rank " << rank;
      if (c.inject == Inject::LossOnly) {
        EXPECT_EQ(bad_elements, 0) << "rank " << rank;
      } else {
        EXPECT_GT(bad_elements, 0) << "rank " << rank;
      }
      continue;
    }
    ASSERT_TRUE(r.error) << "rank " << rank << " did not throw";
    EXPECT_FALSE(stepped) << "rank " << rank;
    EXPECT_EQ(bad_elements, 0) << "rank " << rank;
    const std::string& what = *r.error;
    EXPECT_NE(what.find("on rank " + std::to_string(rank) + " "), std::string::npos) << what;
    EXPECT_NE(what.find("step " + std::to_string(kBad + 1)), std::string::npos) << what;
    // Every rank of a pipeline reports its replica's loss, which the last stage computed.
    std::string culprit = "rank " + std::to_string(c.world - 1);
    if (c.mode == Mode::Pipeline && c.world > 1) {
      culprit = "ranks 0";
      for (int r = 1; r < c.world; ++r) culprit += ", " + std::to_string(r);
    }
    if (c.inject == Inject::Gradient) {
      EXPECT_NE(what.find("every rank's loss is finite"), std::string::npos) << what;
    } else {
      EXPECT_NE(what.find("non-finite loss on " + culprit + " ("), std::string::npos) << what;
    }
  }
  if (!c.check) return;
  // The optimizer state was kept too: the next step gives a run's bits that skipped step kBad.
  const auto ref = run(c, data, true);
  for (const auto& [rank, r] : got) {
    EXPECT_TRUE(bitwise_equal(r.next, ref.at(rank).next)) << "rank " << rank;
    EXPECT_EQ(non_finite(r.next), 0) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, NanCheck, ::testing::ValuesIn(cases()), name_of);

}  // namespace
}  // namespace cohort::nan_check_test
