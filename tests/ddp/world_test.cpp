// DDP against one process with ranks as processes (under cohortrun): each
// rank trains its rows of every global batch for 20 steps, every strategy
// with and without bucket views, and ends within 1e-5 of one process on
// the whole batch (computed by every rank itself). With
// COHORT_TEST_DEVICE=cuda the models, the data and the reference live on
// the GPU; ranks as threads cannot share one there, since LibTorch runs
// every thread's CUDA backward on one thread per GPU (scripts/gpu-check.sh).
#include <gtest/gtest.h>

#include "cohort/cohort.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/support/test_device.h"

namespace cohort::testing::ddp_world_test {
namespace {

constexpr int kSteps = 20;
constexpr int64_t kRowsPerRank = 4;

struct Case {
  SyncStrategy strategy;
  bool bucket_view;
};

class DdpWorld : public ::testing::TestWithParam<Case> {};

TEST_P(DdpWorld, TwentyStepsMatchOneProcess) {
  const auto c = GetParam();
  auto comm = world_ptr();
  const int r = comm->rank();
  torch::set_num_threads(1);
  const auto device = test_device();
  torch::manual_seed(11);  // the same reference and data on every rank
  auto reference = make_ddp_mlp();
  reference->to(device);
  const auto init = clone_all(reference->parameters());
  const auto xs = torch::randn({kSteps, comm->size() * kRowsPerRank, 8}).to(device);
  const auto ys = torch::randn({kSteps, comm->size() * kRowsPerRank, 4}).to(device);
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(xs[s]), ys[s]).backward();
    ref_opt.step();
  }
  const auto expected = clone_all(reference->parameters());
  ASSERT_GT(max_abs_diff(expected, init), 1e-2) << "training must move the parameters";

  torch::manual_seed(100 + r);  // ranks start apart: DDP broadcasts rank 0's
  auto model = make_ddp_mlp();
  model->to(device);
  if (r == 0) copy_parameters(*model, init);
  DDPOptions options;
  options.bucket_cap_mb = 0.0005;  // ~130 floats: several buckets
  options.first_bucket_mb = 0.0002;
  options.strategy = c.strategy;
  options.gradient_as_bucket_view = c.bucket_view;
  DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto x = xs[s].narrow(0, r * kRowsPerRank, kRowsPerRank);
    auto y = ys[s].narrow(0, r * kRowsPerRank, kRowsPerRank);
    torch::mse_loss(ddp.forward(x), y).backward();
    opt.step();
  }
  EXPECT_GT(ddp.stats().buckets, 2) << "bucket caps should split the model";
  EXPECT_LT(max_abs_diff(clone_all(ddp.parameters()), expected), 1e-5) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpWorld,
                         ::testing::Values(Case{SyncStrategy::Overlapped, false},
                                           Case{SyncStrategy::Overlapped, true},
                                           Case{SyncStrategy::Synchronous, false}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.strategy == SyncStrategy::Overlapped
                                                  ? "overlapped"
                                                  : "synchronous") +
                                  (info.param.bucket_view ? "_bucketview" : "");
                         });

}  // namespace
}  // namespace cohort::testing::ddp_world_test
