// The MoE built without a seed draws one from LibTorch's default CPU
// generator, as the tensor-parallel layers do: two layers of one shape
// differ, torch::manual_seed draws the same layer again, and every rank of
// its ep, tp and cp groups holds its slice of one full set of weights. Built
// with a seed it holds that seed's weights exactly and draws nothing. Over
// meshes of ep 1, 2, 3, ep 2 x tp 2, ep 2 x tp 2 x cp 2 and dp 2 x ep 2,
// ranks as threads (which share the default generator).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/mesh/device_mesh.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"

namespace cohort::testing::unseeded_moe_test {
namespace {

using namespace cohort::expert_parallel;

// 6 experts divide by every ep here, F = 4 by every tp.
constexpr int64_t kHidden = 3, kFfn = 4, kExperts = 6;

struct Shape {
  int dp, ep, tp, cp;
  int ranks() const { return dp * ep * tp * cp; }
};

std::string name_of(const Shape& s) {
  return "dp" + std::to_string(s.dp) + "_ep" + std::to_string(s.ep) + "_tp" + std::to_string(s.tp) +
         "_cp" + std::to_string(s.cp);
}

MoEOptions plain() {
  MoEOptions o;
  o.hidden = kHidden;
  o.ffn = kFfn;
  o.experts = kExperts;
  return o;
}

MoE build(const std::shared_ptr<Communicator>& world, const Shape& s, MoEOptions o = plain()) {
  return MoE(init_device_mesh(world, {s.dp, s.ep, s.tp, s.cp}, {"dp", "ep", "tp", "cp"}),
             std::move(o));
}

std::vector<torch::Tensor> weights_of(const MoE& m) {
  return {m->router, m->w1, m->b1, m->w2, m->b2};
}
const char* const kNames[] = {"router", "w1", "b1", "w2", "b2"};

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// This rank's part of the full (ep = 1, tp = 1) weights of `seed`: its
// experts and, over tp, its F / tp slice of each (w1, b1 along 1, w2 along 2).
std::vector<torch::Tensor> part_of_full(const MoE& m, uint64_t seed) {
  MoEOptions o = plain();
  o.seed = seed;
  MoE full(o);
  const auto& tp = m->options().tp_group;
  const int64_t t = tp ? tp->size() : 1, at = tp ? tp->rank() * (kFfn / t) : 0;
  auto experts = [&](const torch::Tensor& w) {
    return w.narrow(0, m->first_expert(), m->local_experts());
  };
  return {full->router, experts(full->w1).narrow(1, at, kFfn / t),
          experts(full->b1).narrow(1, at, kFfn / t), experts(full->w2).narrow(2, at, kFfn / t),
          experts(full->b2)};
}

class UnseededMoE : public ::testing::TestWithParam<Shape> {};

// The second layer of a shape is not a copy of the first: every part of
// every rank differs.
TEST_P(UnseededMoE, TwoLayersOfOneShapeDiffer) {
  const Shape s = GetParam();
  run_ranks_shared(s.ranks(), [&](std::shared_ptr<Communicator> world) {
    const auto a = weights_of(build(world, s)), b = weights_of(build(world, s));
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = max_abs_diff(a[i], b[i]);
      EXPECT_GT(d, 0.0) << kNames[i] << " of two layers on rank " << world->rank()
                        << ": max |difference| " << d;
    }
  });
}

// torch::manual_seed(s) before the layer draws the same layer again on
// every rank, and another s another layer.
TEST_P(UnseededMoE, ManualSeedDrawsTheSameLayerAgain) {
  const Shape s = GetParam();
  auto draw = [&](uint64_t seed) {
    torch::manual_seed(seed);
    return results_of_ranks<std::vector<torch::Tensor>>(
        s.ranks(),
        [&](std::shared_ptr<Communicator> world) { return weights_of(build(world, s)); });
  };
  const auto a = draw(11), again = draw(11), other = draw(12);
  for (const auto& [rank, w] : a) {
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_TRUE(torch::equal(w[i], again.at(rank)[i]))
          << kNames[i] << " on rank " << rank << ": max |difference| "
          << max_abs_diff(w[i], again.at(rank)[i]);
      const double d = max_abs_diff(w[i], other.at(rank)[i]);
      EXPECT_GT(d, 0.0) << kNames[i] << " on rank " << rank
                        << " under manual_seed 11 and 12: max |difference| " << d;
    }
  }
}

// Every rank of the mesh (ep, tp, cp and the dp replicas) uses one seed,
// and its experts are its slice of that seed's full set (the router the
// whole one).
TEST_P(UnseededMoE, EveryRankHoldsItsSliceOfOneFullSet) {
  const Shape s = GetParam();
  run_ranks_shared(s.ranks(), [&](std::shared_ptr<Communicator> world) {
    const MoE m = build(world, s);
    auto seeds = torch::empty({world->size()}, torch::kInt64);
    world->all_gather_into_tensor(seeds, torch::tensor({static_cast<int64_t>(m->seed())})).wait();
    EXPECT_TRUE(seeds.eq(seeds[0]).all().item<bool>()) << "seeds " << seeds;
    EXPECT_FALSE(m->options().seed.has_value());
    const auto got = weights_of(m), want = part_of_full(m, m->seed());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], want[i]))
          << kNames[i] << " on rank " << world->rank() << ": max |difference| "
          << max_abs_diff(got[i], want[i]);
    }
  });
}

// The full weights an explicit seed gave before seeds were optional: drawn
// in this order from a generator of that seed, uniform in +-1/sqrt(fan in).
std::vector<torch::Tensor> seeded_full(uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto uniform = [&](at::IntArrayRef sizes, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return torch::empty(sizes).uniform_(-bound, bound, gen);
  };
  const int64_t e = kExperts, h = kHidden, f = kFfn;
  return {uniform({e, h}, h), uniform({e, f, h}, h), uniform({e, f}, h), uniform({e, h, f}, f),
          uniform({e, h}, f)};
}

// An explicit seed: that seed's weights exactly, and the default generator
// untouched.
TEST_P(UnseededMoE, AnExplicitSeedDrawsItsWeightsAndNothingElse) {
  const Shape s = GetParam();
  torch::manual_seed(3);
  const auto before = at::detail::getDefaultCPUGenerator().get_state();
  const auto full = seeded_full(5);
  run_ranks_shared(s.ranks(), [&](std::shared_ptr<Communicator> world) {
    MoEOptions o = plain();
    o.seed = 5;
    const MoE m = build(world, s, o);
    EXPECT_EQ(m->seed(), 5u);
    const int64_t t = s.tp,
                  at = (m->options().tp_group ? m->options().tp_group->rank() : 0) * (kFfn / t);
    auto experts = [&](const torch::Tensor& w) {
      return w.narrow(0, m->first_expert(), m->local_experts());
    };
    const std::vector<torch::Tensor> want = {
        full[0], experts(full[1]).narrow(1, at, kFfn / t), experts(full[2]).narrow(1, at, kFfn / t),
        experts(full[3]).narrow(2, at, kFfn / t), experts(full[4])};
    const auto got = weights_of(m);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], want[i])) << kNames[i] << " on rank " << world->rank();
    }
  });
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
}

INSTANTIATE_TEST_SUITE_P(ExpertParallel, UnseededMoE,
                         ::testing::Values(Shape{1, 1, 1, 1}, Shape{1, 2, 1, 1}, Shape{1, 3, 1, 1},
                                           Shape{1, 2, 2, 1}, Shape{1, 2, 2, 2}, Shape{2, 2, 1, 1}),
                         [](const auto& info) { return name_of(info.param); });

// One layer is one draw of 64 bits from the default generator.
TEST(UnseededMoELayer, DrawsOneValueFromTheDefaultGenerator) {
  torch::manual_seed(21);
  auto want = at::detail::createCPUGenerator(21);
  const uint64_t first = at::check_generator<at::CPUGeneratorImpl>(want)->random64();
  const uint64_t second = at::check_generator<at::CPUGeneratorImpl>(want)->random64();
  EXPECT_EQ(MoE(plain())->seed(), first);
  EXPECT_EQ(MoE(plain())->seed(), second);
}

// A seed on some ranks only would leave those without one waiting in the
// draw's all-gather: refused on every rank, naming both.
TEST(UnseededMoELayer, ASeedOnSomeRanksOnlyIsRefused) {
  auto errors = errors_on_every_rank(2, [](std::shared_ptr<Communicator> g) {
    MoEOptions o = plain();
    if (g->rank() == 1) o.seed = 8;
    o.ep_group = g;
    MoE m(o);
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("seed differs across the expert-parallel group: rank 0 has none, "
                             "rank 1 has 8"),
              std::string::npos)
        << errors[r];
  }
}

// Over a mesh, a seed on one data-parallel replica only is refused too.
TEST(UnseededMoELayer, ASeedOnOneReplicaOnlyIsRefused) {
  auto errors = errors_on_every_rank(2, [](std::shared_ptr<Communicator> g) {
    MoEOptions o = plain();
    if (g->rank() == 0) o.seed = 4;
    MoE m(DeviceMesh::from_group(g, "dp"), o);
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(
        errors[r].find("seed differs across the replica group: rank 0 has 4, rank 1 has none"),
        std::string::npos)
        << errors[r];
  }
}

}  // namespace
}  // namespace cohort::testing::unseeded_moe_test
