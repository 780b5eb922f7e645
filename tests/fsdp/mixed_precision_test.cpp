// fully_shard's MixedPrecisionPolicy, ranks as threads:
// - the all-gather bytes, read from Communicator::stats(), are the closed
//   form from the parameter sizes (padding included), and bfloat16 moves
//   exactly half of float32's;
// - after 10 steps the float32 master weights equal a one-process reference
//   that applies the same casts (bfloat16 copies of the weights compute each
//   rank's slice of the batch; the gradients are accumulated and averaged
//   in reduce_dtype) within kTolerance, at world 1 to 3, with shapes that do
//   not divide by the world size, a tied weight and accumulation;
// - reduce-scatters start during backward (the gradient accumulators stay
//   hooked although the parameters change dtype);
// - ranks that disagree on the policy fail on every rank.
// With COHORT_TEST_DEVICE=cuda the models, the data and the reference live
// on the GPU (fsdp_test_models.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/fsdp/fully_shard.h"
#include "support/rank_errors.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::mixed_precision_test {
namespace {

using namespace fsdp_test;

// The same casts in the same order on the same values: measured equal to
// the last bit at world 1 to 3. 1e-6 leaves room only for the order of the
// float32 sum on the wire; reducing in bfloat16 instead of float32 misses
// the reference by 1e-4 to 5e-4, computing in float32 by far more.
constexpr double kTolerance = 1e-6;

MixedPrecisionPolicy bf16_policy(torch::Dtype reduce) {
  MixedPrecisionPolicy p;
  p.param_dtype = torch::kBFloat16;
  p.reduce_dtype = reduce;
  return p;
}

// The inner units compute in bfloat16 and hand bfloat16 on; the root's
// output is float32 for the loss.
FullyShard mixed_model(const std::shared_ptr<Communicator>& comm, MixedPrecisionPolicy policy,
                       bool reshard_after_forward) {
  FullyShardOptions inner{reshard_after_forward, policy};
  FullyShardOptions root = inner;
  root.mp_policy.output_dtype = torch::kFloat;
  return fully_shard(make_model(comm, inner), comm, root);
}

// Elements of one rank's padded shard of parameters of these shapes.
int64_t shard_numel(const std::vector<std::vector<int64_t>>& shapes, int world) {
  int64_t n = 0;
  for (const auto& s : shapes) {
    const int64_t rows = s.empty() ? 1 : s[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < s.size(); ++d) row_numel *= s[d];
    n += (rows + world - 1) / world * row_numel;
  }
  return n;
}

uint64_t all_gather_bytes(const Communicator& comm) {
  return comm.stats()[OpKind::AllGatherIntoTensor].bytes_sent;
}

class MixedPrecisionBytes : public ::testing::TestWithParam<int> {};

TEST_P(MixedPrecisionBytes, Bf16AllGathersHalfTheBytesOfFp32) {
  const int world = GetParam();
  constexpr int kSteps3 = 3;
  // make_model's units: the root (tied [5, 7], Linear(5, 5)) and two Linears.
  const int64_t root = shard_numel({{5, 7}, {5, 5}, {5}}, world);
  const int64_t inner = shard_numel({{6, 7}, {6}}, world) + shard_numel({{7, 6}, {7}}, world);
  // Per step: the root gathers once, the inner units for forward and again
  // for backward; each all-gather of m bytes per rank sends (world - 1) m.
  const uint64_t elements = kSteps3 * (world - 1) * (root + 2 * inner);
  // Before each collective of the schedule (5 all-gathers, 3 reduce-scatters,
  // the end of backward) the ranks all-gather a check of 18 int64 words.
  const uint64_t checks = kSteps3 * (world - 1) * (5 + 3 + 1) * 18 * 8;
  std::map<std::string, uint64_t> bytes;
  std::mutex mu;
  for (const auto& [name, policy] : {std::pair<std::string, MixedPrecisionPolicy>{"fp32", {}},
                                     {"bf16", bf16_policy(torch::kFloat)}}) {
    run_ranks_shared(world, [&, name = name, policy = policy](std::shared_ptr<Communicator> comm) {
      auto model = mixed_model(comm, policy, true);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      comm->reset_stats();
      for (int s = 0; s < kSteps3; ++s) {
        opt.zero_grad();
        model->forward(torch::randn({4, 5}, test_device())).square().mean().backward();
        opt.step();
      }
      std::lock_guard<std::mutex> lock(mu);
      bytes[name + std::to_string(comm->rank())] = all_gather_bytes(*comm);
    });
  }
  for (int r = 0; r < world; ++r) {
    const auto rank = std::to_string(r);
    EXPECT_EQ(bytes["fp32" + rank], elements * 4 + checks) << "rank " << r;
    EXPECT_EQ(bytes["bf16" + rank], elements * 2 + checks) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, MixedPrecisionBytes, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "World" + std::to_string(info.param); });

struct MixedCase {
  int world;
  torch::Dtype reduce;
  bool reshard_after_forward;
  int micro_batches;
};

// One process: per rank and micro-batch, a bfloat16 copy of the master
// weights computes that slice; the full gradients accumulate over the
// micro-batches in reduce_dtype, are averaged over the ranks in float32 and
// rounded to reduce_dtype, then become the master weights' float32 .grad.
Named reference(const MixedCase& c, const Batches& b) {
  auto master = make_model(nullptr, {});
  init_parameters(*master, 7);
  torch::optim::AdamW opt(master->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int s = 0; s < kSteps; ++s) {
    std::map<std::string, torch::Tensor> sum;  // float32, over ranks
    for (int r = 0; r < c.world; ++r) {
      auto copy = make_model(nullptr, {});
      copy->to(torch::kBFloat16);
      {
        torch::NoGradGuard no_grad;
        for (const auto& p : master->named_parameters()) {
          copy->named_parameters()[p.key()].copy_(p.value());
        }
      }
      const int64_t n = kBatch / c.world / c.micro_batches;
      std::map<std::string, torch::Tensor> acc;  // reduce_dtype, over micro-batches
      for (int m = 0; m < c.micro_batches; ++m) {
        const int64_t at = r * n * c.micro_batches + m * n;
        auto x = b.x[s].narrow(0, at, n), y = b.y[s].narrow(0, at, n);
        for (auto& p : copy->parameters()) p.mutable_grad() = torch::Tensor();
        auto out = copy->forward(x.to(torch::kBFloat16)).to(torch::kFloat);
        (torch::mse_loss(out, y) / c.micro_batches).backward();
        for (const auto& p : copy->named_parameters()) {
          auto g = p.value().grad();
          // The tied weight appears under its first name only.
          if (!g.defined() || p.key() == "6.w") continue;
          auto& a = acc[p.key()];
          a = a.defined() ? a + g.to(c.reduce) : g.to(c.reduce);
        }
      }
      for (auto& [key, g] : acc) {
        auto& t = sum[key];
        t = t.defined() ? t + g.to(torch::kFloat) : g.to(torch::kFloat);
      }
    }
    opt.zero_grad();
    for (const auto& p : master->named_parameters()) {
      if (p.key() == "6.w") continue;
      p.value().mutable_grad() = (sum.at(p.key()) / c.world).to(c.reduce).to(torch::kFloat);
    }
    opt.step();
  }
  return parameters_of(*master);
}

std::string name_of(const ::testing::TestParamInfo<MixedCase>& info) {
  const auto& c = info.param;
  return "World" + std::to_string(c.world) +
         (c.reduce == torch::kFloat ? "ReduceFp32" : "ReduceBf16") +
         (c.reshard_after_forward ? "Reshard" : "Keep") + std::to_string(c.micro_batches) + "Micro";
}

class MixedPrecisionGolden : public ::testing::TestWithParam<MixedCase> {};

TEST_P(MixedPrecisionGolden, MasterWeightsEqualOneProcessWithTheSameCasts) {
  const auto c = GetParam();
  const auto batches = make_batches(11);
  const auto expected = reference(c, batches);
  std::mutex mu;
  std::map<int, Named> got;
  run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto model = mixed_model(comm, bf16_policy(c.reduce), c.reshard_after_forward);
    auto twin = make_model(nullptr, {});
    init_parameters(*twin, 7);
    load_from(model, *twin);
    // The optimizer sees the float32 shards.
    for (const auto& p : model->parameters()) ASSERT_EQ(p.scalar_type(), torch::kFloat);
    torch::optim::AdamW opt(model->parameters(),
                            torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto x = local(batches.x[s], *comm), y = local(batches.y[s], *comm);
      const int64_t n = x.size(0) / c.micro_batches;
      for (int m = 0; m < c.micro_batches; ++m) {
        model->set_requires_gradient_sync(m + 1 == c.micro_batches);
        auto out = model->forward(x.narrow(0, m * n, n));
        EXPECT_EQ(out.scalar_type(), torch::kFloat);
        (torch::mse_loss(out, y.narrow(0, m * n, n)) / c.micro_batches).backward();
      }
      for (const auto& p : model->parameters()) {
        ASSERT_EQ(p.grad().scalar_type(), torch::kFloat);
        ASSERT_EQ(p.grad().sizes(), p.sizes());
      }
      opt.step();
    }
    auto state = model->full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    got[comm->rank()] = state;
  });
  for (const auto& [rank, state] : got) {
    for (const auto& e : state) EXPECT_EQ(e.value().scalar_type(), torch::kFloat) << e.key();
    expect_close(state, expected, kTolerance, "rank " + std::to_string(rank));
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, MixedPrecisionGolden,
                         ::testing::Values(MixedCase{1, torch::kFloat, true, 1},
                                           MixedCase{2, torch::kFloat, true, 1},
                                           MixedCase{3, torch::kFloat, true, 1},
                                           MixedCase{2, torch::kBFloat16, true, 1},
                                           MixedCase{3, torch::kBFloat16, false, 1},
                                           MixedCase{2, torch::kFloat, false, 2},
                                           MixedCase{3, torch::kBFloat16, true, 2}),
                         name_of);

TEST(MixedPrecision, ReduceScattersStartDuringBackward) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = mixed_model(comm, bf16_policy(torch::kFloat), true);
    for (int s = 0; s < 2; ++s) {
      auto x = torch::randn({4, 5}, test_device()).requires_grad_();
      uint64_t launched = 0;
      // The input's gradient is the last thing backward computes before
      // its end; by then both inner units have had all their gradients.
      x.register_hook([&](const torch::Tensor&) {
        launched = comm->stats()[OpKind::ReduceScatterTensor].calls;
      });
      comm->reset_stats();
      model->forward(x).square().mean().backward();
      EXPECT_GE(launched, 2u) << "step " << s;
      EXPECT_EQ(comm->stats()[OpKind::ReduceScatterTensor].calls, 3u) << "step " << s;
    }
  });
}

TEST(MixedPrecisionErrors, RanksThatDisagreeOnThePolicyFailOnEveryRank) {
  const auto errors = errors_on_every_rank(3, [](std::shared_ptr<Communicator> comm) {
    FullyShardOptions o;
    if (comm->rank() == 2) o.mp_policy.param_dtype = torch::kBFloat16;
    FullyShard(AnyModule(Linear(3, 3)), comm, o);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("fully_shard"), std::string::npos) << e;
    EXPECT_NE(e.find("mixed precision policy differs"), std::string::npos) << e;
    EXPECT_NE(e.find("param_dtype=bfloat16"), std::string::npos) << e;
    EXPECT_NE(e.find("on rank 2"), std::string::npos) << e;
  }
  const auto reduce = errors_on_every_rank(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardOptions o;
    o.mp_policy = bf16_policy(comm->rank() == 1 ? torch::kFloat : torch::kBFloat16);
    FullyShard(AnyModule(Linear(3, 3)), comm, o);
  });
  for (const auto& e : reduce) {
    EXPECT_NE(e.find("reduce_dtype=float32"), std::string::npos) << e;
    EXPECT_NE(e.find("on rank 1"), std::string::npos) << e;
  }
}

TEST(MixedPrecisionErrors, AnIntegerParamDtypeIsRefused) {
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    FullyShardOptions o;
    o.mp_policy.param_dtype = torch::kInt;
    EXPECT_THROW(FullyShard(AnyModule(Linear(3, 3)), comm, o), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing::mixed_precision_test
