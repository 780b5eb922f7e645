// checkpoint under CPU autocast (bfloat16): the recompute, which runs in
// backward outside the caller's autocast, casts as the forward did, and a
// weight's cast made at the forward (under no grad) does not reach the
// caller's later uses of the weight through autocast's cast cache. Each
// compares the gradients with the same code run without checkpoint.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/activation/checkpoint.h"
#include "cohort/core/torch_compat.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::checkpoint_autocast_test {
namespace {

using Tensors = std::vector<torch::Tensor>;

// CPU autocast to bfloat16 for the guard's life, then off, with the cast
// cache emptied and back on.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool cache) {
    set_autocast_dtype(c10::kCPU, torch::kBFloat16);
    at::autocast::set_autocast_cache_enabled(cache);
    set_autocast_enabled(c10::kCPU, true);
  }
  ~CpuAutocast() {
    set_autocast_enabled(c10::kCPU, false);
    at::autocast::clear_cache();
    at::autocast::set_autocast_cache_enabled(true);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;
};

struct Result {
  Tensors grads;  // x's, w's
  at::ScalarType out_dtype;
};

// fn = sin(x @ w), through checkpoint or not, under autocast; then, in the
// same autocast region, `extra` (a second use of w outside fn, or none);
// backward after autocast ends.
Result run(bool checkpointed, bool cache, bool float_output, bool extra) {
  auto gen = at::detail::createCPUGenerator(7);
  auto x = torch::randn({4, 8}, gen).requires_grad_(true);
  auto w = torch::randn({8, 8}, gen).requires_grad_(true);
  auto x2 = torch::randn({4, 8}, gen);
  CheckpointFunction fn = [w, float_output](const Tensors& in) {
    auto h = torch::sin(torch::matmul(in[0], w));
    return Tensors{float_output ? h.to(torch::kFloat) : h};
  };
  torch::Tensor loss;
  Result r;
  {
    CpuAutocast autocast(cache);
    auto out = checkpointed ? checkpoint(fn, {x}, {w}) : fn({x});
    r.out_dtype = out[0].scalar_type();
    loss = weighted_loss(out[0].to(torch::kFloat));
    if (extra) loss = loss + weighted_loss(torch::matmul(x2, w).to(torch::kFloat));
  }
  loss.backward();
  r.grads = {x.grad(), w.grad()};
  return r;
}

TEST(CheckpointAutocast, RecomputeCastsAsTheForward) {
  torch::set_num_threads(1);
  const Result plain = run(false, true, false, false), ckpt = run(true, true, false, false);
  EXPECT_EQ(ckpt.out_dtype, torch::kBFloat16);
  EXPECT_TRUE(bitwise_equal(ckpt.grads, plain.grads));
}

// With the cache on, a cast of w cached at the checkpoint's forward, under
// no grad, would serve the later matmul, and w would get no gradient from
// it. The reference runs with the cache off: the cache also shares one cast
// among w's uses, whose gradients then add up in bfloat16 rather than in
// float32 per use, and checkpoint keeps it off while fn runs.
TEST(CheckpointAutocast, CastCacheKeepsTheWeightsHistory) {
  torch::set_num_threads(1);
  const Result plain = run(false, false, true, true), ckpt = run(true, true, true, true);
  EXPECT_TRUE(bitwise_equal(ckpt.grads, plain.grads))
      << "w.grad sum " << ckpt.grads[1].sum().item<double>() << " against "
      << plain.grads[1].sum().item<double>() << " without checkpoint";
}

}  // namespace
}  // namespace cohort::testing::checkpoint_autocast_test
