// checkpoint under every kind of parallelism, ranks as threads: each rank's
// gradients with checkpointing are bitwise those without, for the GPT's
// tensor-parallel blocks at tp = 2 (their recompute re-runs collectives),
// with dropout from the stage's RngTracker (the recompute must restore its
// generators), a pipeline stage under 1F1B and ZB-H1 (ZB-H1 recomputes for I and again
// for W), DDP and ZeRO-2 (gradients reach their hooks on the accumulators).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/activation/checkpoint.h"
#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/thread_ranks.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::parallel_test {
namespace {

using Tensors = std::vector<torch::Tensor>;
using Grads = std::map<std::string, torch::Tensor>;  // "name@rank" -> gradient

// Collects each rank's gradients of `params` (or their values), keyed by
// name and rank.
class GradSink {
 public:
  void add(int rank, const torch::OrderedDict<std::string, torch::Tensor>& params,
           bool values = false) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : params) {
      const auto& g = values ? p.value() : p.value().grad();
      grads_[p.key() + "@" + std::to_string(rank)] = g.defined() ? g.clone() : g;
    }
  }
  Grads take() { return std::move(grads_); }

 private:
  std::mutex mu_;
  Grads grads_;
};

void expect_bitwise(const Grads& got, const Grads& expected) {
  ASSERT_EQ(got.size(), expected.size());
  ASSERT_FALSE(expected.empty());
  for (const auto& [name, g] : expected) {
    ASSERT_TRUE(got.count(name)) << name;
    ASSERT_TRUE(g.defined()) << name << " got no gradient without checkpointing";
    ASSERT_TRUE(got.at(name).defined()) << name << " got no gradient with checkpointing";
    EXPECT_TRUE(torch::equal(got.at(name), g))
        << name << " differs by " << (got.at(name) - g).abs().max().item<double>();
  }
}

// --- tensor parallelism: the GPT, tp = 2 (and pp = 2 through a schedule) ----

struct TpCase {
  bool sequence_parallel;
  int pp;
  std::string schedule;  // pp > 1
  double dropout = 0;    // drawn from the stage's RngTracker, which the recompute restores
};

Grads gpt_grads(const TpCase& k, bool checkpointed) {
  GradSink sink;
  run_ranks_shared(2 * k.pp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {k.pp, 1, 2}, {"pp", "dp", "tp"});
    tensor_parallel::GPTConfig c;
    c.vocab_size = 12, c.seq_len = 6, c.hidden = 24, c.heads = 6, c.layers = 2 * k.pp;
    c.sequence_parallel = k.sequence_parallel;
    c.checkpoint_activations = checkpointed;
    c.dropout = k.dropout;
    tensor_parallel::GPTStage stage(mesh, c);
    auto ids = torch::randint(c.vocab_size, {4, c.seq_len}, at::detail::createCPUGenerator(100));
    auto targets = (ids * 5 + 3) % c.vocab_size;
    if (k.pp == 1) {
      stage->loss(stage(ids), targets).backward();
    } else {
      pipeline::PipelineRuntime rt(mesh["pp"], {gpt_pipeline_stage(mesh, stage)},
                                   pipeline::make_schedule(k.schedule, k.pp, 1, 2),
                                   gpt_pipeline_loss(stage));
      rt.step({ids}, {targets});
    }
    sink.add(world->rank(), stage->named_parameters());
  });
  return sink.take();
}

class CheckpointTensorParallel : public ::testing::TestWithParam<TpCase> {};

TEST_P(CheckpointTensorParallel, GradientsAreBitwiseThoseWithout) {
  expect_bitwise(gpt_grads(GetParam(), true), gpt_grads(GetParam(), false));
}

INSTANTIATE_TEST_SUITE_P(Tp2, CheckpointTensorParallel,
                         ::testing::Values(TpCase{false, 1, ""}, TpCase{true, 1, ""},
                                           TpCase{false, 2, "1f1b"}, TpCase{true, 2, "zbh1"},
                                           TpCase{false, 1, "", 0.2}, TpCase{true, 1, "", 0.2},
                                           TpCase{true, 2, "zbh1", 0.2}),
                         [](const auto& info) {
                           const auto& k = info.param;
                           return std::string(k.sequence_parallel ? "sp" : "nosp") + "_pp" +
                                  std::to_string(k.pp) + (k.pp > 1 ? "_" + k.schedule : "") +
                                  (k.dropout > 0 ? "_dropout" : "");
                         });

// --- the pipeline: an MLP of 4 blocks on 2 stages ---------------------------

struct PipeCase {
  std::string schedule;
  bool function_stage;  // a ForwardFn stage (W from the roots) or a Sequential (W per unit)
};

// `calls` counts the runs of a function stage's forward, recomputes included.
pipeline::PipelineStage make_stage(int r, torch::nn::Sequential seq, bool function_stage,
                                   bool checkpointed, std::shared_ptr<int> calls) {
  if (!function_stage)
    return pipeline::PipelineStage(r, checkpointed ? checkpoint_blocks(seq) : seq);
  auto fn = [seq, checkpointed, calls](const Tensors& in) {
    auto forward = [seq, calls](const Tensors& t) mutable {
      ++*calls;
      return Tensors{seq->forward(t[0])};
    };
    return checkpointed ? checkpoint(forward, in, seq->parameters()) : forward(in);
  };
  return pipeline::PipelineStage(r, fn, seq->parameters(), seq.ptr());
}

constexpr int kMicrobatches = 4;

// The gradients, and how often each rank ran a function stage's forward.
std::pair<Grads, std::vector<int>> pipeline_grads(const PipeCase& k, bool checkpointed) {
  GradSink sink;
  std::vector<int> calls(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    auto seq = pipeline::split_sequential(make_mlp(4, 6), {4}, r);
    auto mse = [](const Tensors& out, const Tensors& t) { return torch::mse_loss(out[0], t[0]); };
    auto count = std::make_shared<int>(0);
    pipeline::PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                                 {make_stage(r, seq, k.function_stage, checkpointed, count)},
                                 pipeline::make_schedule(k.schedule, 2, 1, kMicrobatches), mse);
    rt.step({torch::randn({8, 6}, at::detail::createCPUGenerator(1))},
            {torch::randn({8, 6}, at::detail::createCPUGenerator(2))});
    sink.add(r, seq->named_parameters());
    calls[r] = *count;
  });
  return {sink.take(), calls};
}

class CheckpointPipeline : public ::testing::TestWithParam<PipeCase> {};

TEST_P(CheckpointPipeline, GradientsAreBitwiseThoseWithout) {
  const PipeCase k = GetParam();
  auto [with, with_calls] = pipeline_grads(k, true);
  auto [without, without_calls] = pipeline_grads(k, false);
  expect_bitwise(with, without);
  if (!k.function_stage) return;
  const int m = kMicrobatches;
  EXPECT_EQ(without_calls, (std::vector<int>{m, m}));
  // Each micro-batch's forward, then a recompute per backward pass that
  // needs this stage: 1F1B's one B; ZB-H1's W, and on stage 1 its I too
  // (stage 0's I has no input gradient to compute, so it skips the stage).
  const std::vector<int> expected =
      k.schedule == "zbh1" ? std::vector<int>{2 * m, 3 * m} : std::vector<int>{2 * m, 2 * m};
  EXPECT_EQ(with_calls, expected);
}

INSTANTIATE_TEST_SUITE_P(Schedules, CheckpointPipeline,
                         ::testing::Values(PipeCase{"1f1b", false}, PipeCase{"zbh1", false},
                                           PipeCase{"1f1b", true}, PipeCase{"zbh1", true}),
                         [](const auto& info) {
                           return info.param.schedule +
                                  (info.param.function_stage ? "_function" : "_sequential");
                         });

// --- DDP: world 1, 2, 3, with and without the unused-parameter search -------

struct DdpCase {
  int world;
  bool find_unused;
};

Grads ddp_grads(const DdpCase& k, bool checkpointed) {
  GradSink sink;
  run_ranks_shared(k.world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    auto model = make_mlp(3, 8);
    DDPOptions options;
    options.bucket_cap_mb = 0.0005;  // ~130 floats: several buckets
    options.first_bucket_mb = 0.0002;
    options.find_unused_parameters = k.find_unused;
    DistributedDataParallel<torch::nn::Sequential> ddp(
        checkpointed ? checkpoint_blocks(model) : model, comm, options);
    // Rank-dependent rows, so the average is not any one rank's gradient.
    auto x = torch::randn({3 * k.world, 8}, at::detail::createCPUGenerator(1)).narrow(0, 3 * r, 3);
    weighted_loss(ddp.forward(x)).backward();
    sink.add(r, model->named_parameters());
  });
  return sink.take();
}

class CheckpointDdp : public ::testing::TestWithParam<DdpCase> {};

TEST_P(CheckpointDdp, GradientsAreBitwiseThoseWithout) {
  expect_bitwise(ddp_grads(GetParam(), true), ddp_grads(GetParam(), false));
}

INSTANTIATE_TEST_SUITE_P(Worlds, CheckpointDdp,
                         ::testing::Values(DdpCase{1, false}, DdpCase{2, false}, DdpCase{3, false},
                                           DdpCase{2, true}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) +
                                  (info.param.find_unused ? "_find_unused" : "");
                         });

// ZeRO-2 alone: the gradients go straight from the accumulators' hooks into
// reduce-scatters; compared are the parameters after one AdamW step.
Grads zero2_params(int world, bool checkpointed) {
  GradSink sink;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    auto model = make_mlp(3, 8);
    auto net = checkpointed ? checkpoint_blocks(model) : model;
    ZeroOptions zo;
    zo.stage = 2;
    zo.bucket_cap_mb = 0.0005;
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
        net->parameters(), comm, torch::optim::AdamWOptions(0.01), zo);
    zero->zero_grad();
    auto x = torch::randn({3 * world, 8}, at::detail::createCPUGenerator(1)).narrow(0, 3 * r, 3);
    weighted_loss(net->forward(x)).backward();
    zero->step();
    sink.add(r, model->named_parameters(), /*values=*/true);
  });
  return sink.take();
}

class CheckpointZero : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointZero, Stage2StepIsBitwiseThatWithout) {
  expect_bitwise(zero2_params(GetParam(), true), zero2_params(GetParam(), false));
}

INSTANTIATE_TEST_SUITE_P(Worlds, CheckpointZero, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::parallel_test
