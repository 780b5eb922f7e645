// Pipeline x data parallel on 4 ranks (pp 2 x dp 2): with an all-reduce of
// the stage gradients once per step, and with ZeRO-1 over the DP group;
// both must equal one process on the whole batch. With
// COHORT_TEST_DEVICE=cuda the models, the data and the reference live on
// the GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/grad_sync/average_gradients.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/tensor_checks.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline::composition_test {
namespace {

using namespace cohort::pipeline::testing;

constexpr int kPP = 2, kDP = 2, kM = 3;

struct Mesh {
  std::shared_ptr<Communicator> pp, dp;
  int pp_rank, dp_rank;
};

// rank = dp_rank * pp + pp_rank: pipeline groups are consecutive ranks.
Mesh make_mesh(Communicator& world) {
  Mesh m;
  m.pp_rank = world.rank() % kPP;
  m.dp_rank = world.rank() / kPP;
  m.pp = world.split(m.dp_rank, m.pp_rank);
  m.dp = world.split(m.pp_rank, m.dp_rank);
  return m;
}

using cohort::testing::expect_close;

TEST(PipelineComposition, PipelineTimesDataParallelEqualsOneProcess) {
  const auto device = cohort::testing::test_device();
  const auto x = det({kDP * 2 * kM, kWidth}, 0.4).to(device);
  const auto y = det({kDP * 2 * kM, kWidth}, 1.3).to(device);
  const Reference ref = reference_run(kPP, x, y, kM);
  cohort::testing::run_ranks(kDP * kPP, [&](Communicator& world) {
    Mesh mesh = make_mesh(world);
    auto model = make_mlp(kPP, device);
    const int s = mesh.pp_rank;
    PipelineRuntime rt(cohort::DeviceMesh::from_group(mesh.pp, "pp"),
                       {PipelineStage(s, split_sequential(model, {2}, s))}, Schedule1F1B(kPP, kM),
                       mse);
    auto xs = x.chunk(kDP), ys = y.chunk(kDP);
    auto r = rt.step({xs[mesh.dp_rank]}, {ys[mesh.dp_rank]});
    average_gradients(rt.parameters(), *mesh.dp);
    const Reference shard = reference_run(kPP, xs[mesh.dp_rank], ys[mesh.dp_rank], kM);
    for (int i = 0; i < kM; ++i) EXPECT_NEAR(r.losses[i], shard.losses[i], 1e-5 * shard.losses[i]);
    auto params = model->parameters();
    for (int k : {2 * s, 2 * s + 1}) expect_close(params[k].grad(), ref.grads[k], "grad");
  });
}

TEST(PipelineComposition, PipelineWithZeroOneEqualsOneProcess) {
  const double lr = 0.1;
  const auto device = cohort::testing::test_device();
  const auto x = det({kDP * 2 * kM, kWidth}, 0.4).to(device);
  const auto y = det({kDP * 2 * kM, kWidth}, 1.3).to(device);
  // One process: one SGD step on the whole batch.
  auto ref_model = make_mlp(kPP, device);
  torch::nn::functional::mse_loss(ref_model->forward(x), y).backward();
  torch::optim::SGD(ref_model->parameters(), torch::optim::SGDOptions(lr)).step();
  auto ref_params = ref_model->parameters();
  cohort::testing::run_ranks(kDP * kPP, [&](Communicator& world) {
    Mesh mesh = make_mesh(world);
    auto model = make_mlp(kPP, device);
    const int s = mesh.pp_rank;
    PipelineRuntime rt(cohort::DeviceMesh::from_group(mesh.pp, "pp"),
                       {PipelineStage(s, split_sequential(model, {2}, s))}, ScheduleZBH1(kPP, kM),
                       mse);
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(
        rt.parameters(), mesh.dp, torch::optim::SGDOptions(lr));  // reduces in step()
    auto xs = x.chunk(kDP), ys = y.chunk(kDP);
    zero->zero_grad();
    rt.step({xs[mesh.dp_rank]}, {ys[mesh.dp_rank]});
    zero->step();
    auto params = model->parameters();
    for (int k : {2 * s, 2 * s + 1}) expect_close(params[k], ref_params[k], "parameter");
  });
}

}  // namespace
}  // namespace cohort::pipeline::composition_test
