// checkpoint and module buffers. A recompute runs the block in training mode
// again, where BatchNorm updates its running statistics and
// num_batches_tracked; training with checkpointing must still leave every
// parameter and buffer as training without it does: in one process over a
// few optimizer steps (momentum 0.1 and the cumulative average), and on a
// 2-stage pipeline under 1F1B and ZB-H1 (whose I and W each recompute),
// through checkpoint_blocks and through checkpoint() of a function given
// the buffers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/activation/checkpoint.h"
#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "support/thread_ranks.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::buffers_test {
namespace {

using Tensors = std::vector<torch::Tensor>;
using State = std::map<std::string, torch::Tensor>;  // "name@rank" -> value

// Linear, BatchNorm1d, ReLU per block, then a Linear to width 6. Momentum
// unset makes BatchNorm average over num_batches_tracked, so a miscount
// shows in the statistics too.
torch::nn::Sequential make_bn_mlp(int blocks, bool cumulative) {
  torch::nn::Sequential seq;
  for (int b = 0; b < blocks; ++b) {
    auto bn = torch::nn::BatchNorm1dOptions(8);
    if (cumulative) bn.momentum(c10::nullopt);
    seq->push_back(torch::nn::Linear(b == 0 ? 6 : 8, 8));
    seq->push_back(torch::nn::BatchNorm1d(bn));
    seq->push_back(torch::nn::ReLU());
  }
  seq->push_back(torch::nn::Linear(8, 6));
  init_parameters(*seq, 7);
  return seq;
}

void add_state(State& out, const torch::nn::Module& m, int rank) {
  const std::string at = "@" + std::to_string(rank);
  for (const auto& p : m.named_parameters()) {
    out["param " + p.key() + at] = p.value().detach().clone();
    if (p.value().grad().defined()) out["grad " + p.key() + at] = p.value().grad().clone();
  }
  for (const auto& b : m.named_buffers()) out["buffer " + b.key() + at] = b.value().clone();
}

void expect_bitwise(const State& got, const State& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [name, v] : expected) {
    ASSERT_TRUE(got.count(name)) << name;
    const auto& g = got.at(name);
    EXPECT_TRUE(torch::equal(g, v))
        << name << " differs by "
        << (g.to(torch::kDouble) - v.to(torch::kDouble)).abs().max().item<double>();
  }
}

// The num_batches_tracked of every BatchNorm in `state`.
std::vector<int64_t> batches_tracked(const State& state) {
  std::vector<int64_t> out;
  for (const auto& [name, v] : state)
    if (name.find("num_batches_tracked") != std::string::npos) out.push_back(v.item<int64_t>());
  return out;
}

// --- one process: SGD steps through the model or its checkpointed blocks ---

constexpr int kSteps = 3;

State train(bool checkpointed, bool cumulative) {
  auto model = make_bn_mlp(1, cumulative);
  auto net = checkpointed ? checkpoint_blocks(model) : model;
  torch::optim::SGD sgd(model->parameters(), 0.1);
  auto gen = at::detail::createCPUGenerator(11);
  for (int s = 0; s < kSteps; ++s) {
    sgd.zero_grad();
    weighted_loss(net->forward(torch::randn({8, 6}, gen))).backward();
    sgd.step();
  }
  State out;
  add_state(out, *model, 0);
  model->eval();
  torch::NoGradGuard no_grad;
  out["eval output"] = model->forward(torch::randn({4, 6}, gen));
  return out;
}

class CheckpointBuffers : public ::testing::TestWithParam<bool> {};

TEST_P(CheckpointBuffers, TrainingLeavesThoseWithout) {
  torch::set_num_threads(1);
  const State plain = train(false, GetParam()), ckpt = train(true, GetParam());
  EXPECT_EQ(batches_tracked(plain), std::vector<int64_t>{kSteps});
  EXPECT_EQ(batches_tracked(ckpt), std::vector<int64_t>{kSteps});
  expect_bitwise(ckpt, plain);
}

INSTANTIATE_TEST_SUITE_P(Momentum, CheckpointBuffers, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "cumulative" : "ema"; });

// --- a pipeline: 2 stages as threads, a BatchNorm on each -------------------

constexpr int kMicrobatches = 4;

struct PipeCase {
  std::string schedule;
  bool function_stage;  // checkpoint() of a function, or checkpoint_blocks
};

pipeline::PipelineStage make_stage(int r, torch::nn::Sequential seq, bool function_stage,
                                   bool checkpointed) {
  if (!function_stage)
    return pipeline::PipelineStage(r, checkpointed ? checkpoint_blocks(seq) : seq);
  CheckpointOptions options;
  options.buffers = seq->buffers();
  auto fn = [seq, checkpointed, options](const Tensors& in) {
    auto forward = [seq](const Tensors& t) mutable { return Tensors{seq->forward(t[0])}; };
    return checkpointed ? checkpoint(forward, in, seq->parameters(), options) : forward(in);
  };
  return pipeline::PipelineStage(r, fn, seq->parameters(), seq.ptr());
}

State pipeline_state(const PipeCase& k, bool checkpointed) {
  State state;
  std::mutex mu;
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    // [Linear, BatchNorm, ReLU] | [Linear, BatchNorm, ReLU, Linear]
    auto seq = pipeline::split_sequential(make_bn_mlp(2, false), {3}, r);
    auto mse = [](const Tensors& out, const Tensors& t) { return torch::mse_loss(out[0], t[0]); };
    pipeline::PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                                 {make_stage(r, seq, k.function_stage, checkpointed)},
                                 pipeline::make_schedule(k.schedule, 2, 1, kMicrobatches), mse);
    rt.step({torch::randn({8, 6}, at::detail::createCPUGenerator(1))},
            {torch::randn({8, 6}, at::detail::createCPUGenerator(2))});
    std::lock_guard<std::mutex> lock(mu);
    add_state(state, *seq, r);
  });
  return state;
}

class CheckpointBuffersPipeline : public ::testing::TestWithParam<PipeCase> {};

TEST_P(CheckpointBuffersPipeline, OneUpdatePerMicrobatch) {
  const State plain = pipeline_state(GetParam(), false), ckpt = pipeline_state(GetParam(), true);
  const std::vector<int64_t> once_each{kMicrobatches, kMicrobatches};
  EXPECT_EQ(batches_tracked(plain), once_each);
  EXPECT_EQ(batches_tracked(ckpt), once_each);
  expect_bitwise(ckpt, plain);
}

INSTANTIATE_TEST_SUITE_P(Schedules, CheckpointBuffersPipeline,
                         ::testing::Values(PipeCase{"1f1b", false}, PipeCase{"zbh1", false},
                                           PipeCase{"1f1b", true}, PipeCase{"zbh1", true}),
                         [](const auto& info) {
                           return info.param.schedule +
                                  (info.param.function_stage ? "_function" : "_blocks");
                         });

}  // namespace
}  // namespace cohort::testing::buffers_test
