// Communication hooks: the fp16 and bf16 compression hooks stay within the
// rounding bound of their format (and do round: they are really used), and
// a custom hook sees every bucket once, in index order.
#include <gtest/gtest.h>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::hooks_test {
namespace {

// Reduced gradients of one step with `hook` (null: the default), per rank.
std::vector<torch::Tensor> reduced_grads(std::shared_ptr<Communicator> comm,
                                         std::shared_ptr<CommHook> hook,
                                         const std::vector<torch::Tensor>& init,
                                         const torch::Tensor& x, const torch::Tensor& y) {
  auto model = make_ddp_mlp();
  copy_parameters(*model, init);
  DistributedDataParallel<torch::nn::Sequential> ddp(model, comm);
  if (hook) ddp.register_comm_hook(hook);
  torch::mse_loss(ddp.forward(x), y).backward();
  std::vector<torch::Tensor> out;
  for (auto& p : ddp.parameters()) out.push_back(p.grad().clone());
  return out;
}

struct Compression {
  std::string name;
  std::function<std::shared_ptr<CommHook>()> make;
  double unit_roundoff;  // 2^-(mantissa bits + 1)
};

class CompressionHooks : public ::testing::TestWithParam<Compression> {};

TEST_P(CompressionHooks, BoundedErrorAgainstExactAverage) {
  torch::set_num_threads(1);
  torch::manual_seed(1);
  auto reference = make_ddp_mlp();
  const auto init = clone_all(reference->parameters());
  const auto& c = GetParam();
  constexpr int kWorld = 3;
  const auto xs = torch::randn({kWorld, 8, 8});
  const auto ys = torch::randn({kWorld, 8, 4});
  // sum over ranks of |local gradient| / world, elementwise: what the
  // rounding of each rank's contribution is relative to.
  std::vector<torch::Tensor> magnitude;
  for (int r = 0; r < kWorld; ++r) {
    reference->zero_grad();
    torch::mse_loss(reference->forward(xs[r]), ys[r]).backward();
    auto params = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto m = params[i].grad().abs() / kWorld;
      if (r == 0)
        magnitude.push_back(m);
      else
        magnitude[i] += m;
    }
  }
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto exact = reduced_grads(comm, nullptr, init, xs[r], ys[r]);
    auto compressed = reduced_grads(comm, c.make(), init, xs[r], ys[r]);
    double worst_rel = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      // The ring rounds each of its world-1 partial sums (each at most
      // sum |g_r| / world) and the result once more:
      // |error| <= u ((world-1) sum |g_r| / world + |avg|), plus subnormals.
      auto bound = c.unit_roundoff * ((kWorld - 1) * magnitude[i] + exact[i].abs()) * 1.01 + 1e-7;
      auto err = (compressed[i] - exact[i]).abs();
      EXPECT_TRUE(torch::all(err <= bound).item<bool>())
          << c.name << " param " << i << " worst excess " << (err - bound).max().item<double>();
      worst_rel = std::max(worst_rel, (err / (magnitude[i] + 1e-12)).max().item<double>());
    }
    // The hook really ran: 16-bit rounding is visible somewhere.
    EXPECT_GT(worst_rel, 0) << c.name;
  });
}

INSTANTIATE_TEST_SUITE_P(
    Ddp, CompressionHooks,
    ::testing::Values(
        Compression{"fp16", [] { return std::make_shared<Fp16CompressHook>(); }, 0x1p-11},
        Compression{"bf16", [] { return std::make_shared<Bf16CompressHook>(); }, 0x1p-8}),
    [](const auto& info) { return info.param.name; });

// Records what it was given, then reduces as the default does.
class RecordingHook : public AllReduceHook {
 public:
  Work run(Communicator& comm, GradBucket& bucket) override {
    indices.push_back(bucket.index);
    last_flags.push_back(bucket.is_last);
    numels.push_back(bucket.buffer.numel());
    return AllReduceHook::run(comm, bucket);
  }
  std::vector<int64_t> indices, numels;
  std::vector<bool> last_flags;
};

TEST(DdpCommHook, CustomHookSeesEveryBucketOnceInOrder) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_ddp_mlp();
    DDPOptions options;
    options.bucket_cap_mb = 0.0005;
    options.first_bucket_mb = 0.0002;
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
    auto hook = std::make_shared<RecordingHook>();
    ddp.register_comm_hook(hook);
    ddp.forward(torch::ones({2, 8})).sum().backward();
    const auto layout = ddp.reducer().bucket_layout();
    ASSERT_EQ(hook->indices.size(), layout.size());
    int64_t total = 0;
    for (size_t b = 0; b < layout.size(); ++b) {
      EXPECT_EQ(hook->indices[b], static_cast<int64_t>(b));
      EXPECT_EQ(hook->last_flags[b], b + 1 == layout.size());
      total += hook->numels[b];
    }
    int64_t params = 0;
    for (auto& p : ddp.parameters()) params += p.numel();
    EXPECT_EQ(total, params);
    EXPECT_THROW(ddp.register_comm_hook(nullptr), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing::hooks_test
