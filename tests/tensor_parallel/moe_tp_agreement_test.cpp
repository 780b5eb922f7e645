// What the ranks of an MoE's ep and tp groups must agree on before the rows
// move, each case on an ep x tp mesh of ranks as threads:
// - an input of another width or dtype on one TP rank alone: InvalidArgument
//   on every rank, naming that rank (through its tp group, then its ep group);
// - TP ranks holding different tokens of the same shape (the layer assumes
//   them replicated): InvalidArgument on every rank, never a silent result;
// - every parameter frozen while the input requires grad on one rank only
//   (also over ep alone, ep 1 to 3): the backward exchanges still run on
//   every rank, and the input's gradient is one process's;
// - one rank without grad mode while the others record a backward:
//   InvalidArgument on every rank, naming it, never a wait in backward.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <algorithm>
#include <array>
#include <optional>
#include <ostream>
#include <stdexcept>

#include "cohort/expert_parallel/input_agreement.h"
#include "cohort/expert_parallel/moe.h"
#include "support/rank_errors.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"

namespace cohort::testing::moe_tp_agreement_test {
namespace {

using namespace cohort::expert_parallel;

struct Case {
  std::string backend;
  int ep, tp;
  int world() const { return ep * tp; }
};

std::vector<std::string> backends() {
  std::vector<std::string> out = {"gloo"};
#ifdef COHORT_WITH_UCX
  out.push_back("ucx");
#endif
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& b : backends()) {
    for (auto [ep, tp] : {std::pair{1, 2}, std::pair{1, 3}, std::pair{2, 2}}) {
      out.push_back({b, ep, tp});
    }
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return c.backend + "_ep" + std::to_string(c.ep) + "_tp" + std::to_string(c.tp);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " ep " << c.ep << " x tp " << c.tp;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

MoEOptions options() {
  MoEOptions o;
  o.hidden = 4;
  o.ffn = 6;
  o.experts = 6;  // divides by ep 1, 2 and 3
  o.top_k = 2;
  o.seed = 11;
  return o;
}

// The tokens of ep rank e (alike on its TP ranks).
torch::Tensor tokens(int e) {
  return torch::randn({5, 4}, at::detail::createCPUGenerator(40 + static_cast<uint64_t>(e)));
}

ThreadRanksOptions briefly(const std::string& backend) {
  ThreadRanksOptions o;
  o.backend = backend;
  o.timeout = std::chrono::seconds(3);
  return o;
}

class MoeTpAgreement : public ::testing::TestWithParam<Case> {
 protected:
  // Each rank's error when `fn(mesh, ep rank, tp rank)` runs on every rank
  // of an ep x tp mesh ("tp" the inner dimension: world rank e * tp + t).
  std::vector<std::string> on_mesh(
      const std::function<void(const DeviceMesh&, int, int)>& fn) const {
    const Case k = GetParam();
    return errors_on_every_rank(
        k.world(),
        [&](std::shared_ptr<Communicator> world) {
          torch::set_num_threads(1);
          auto mesh = init_device_mesh(world, {k.ep, k.tp}, {"ep", "tp"});
          fn(mesh, world->rank() / k.tp, world->rank() % k.tp);
        },
        briefly(k.backend));
  }
};

// World rank 1 (ep 0, tp 1) passes another width: its tp peers hear it in
// the tp agreement, the other ep ranks from their ep peers.
TEST_P(MoeTpAgreement, InputOfAnotherWidthOnOneTpRankIsRefusedOnEveryRank) {
  const Case k = GetParam();
  const auto errors = on_mesh([](const DeviceMesh& mesh, int e, int t) {
    MoE m(mesh, options());
    auto x = tokens(e);
    m(e == 0 && t == 1 ? torch::zeros({5, 5}) : x);
  });
  for (int r = 0; r < k.world(); ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "the input's last dimension must be hidden = 4, got 5"))
        << "rank " << r << ": " << e;
    const int ep_rank = r / k.tp, tp_rank = r % k.tp;
    if (r == 1) {
      EXPECT_TRUE(has(e, "this rank's input: ")) << e;
    } else if (ep_rank == 0) {
      EXPECT_TRUE(has(e, "rank 1 of the tensor-parallel group ")) << "rank " << r << ": " << e;
    } else if (tp_rank == 1) {
      EXPECT_TRUE(has(e, "rank 0 of the expert-parallel group ")) << "rank " << r << ": " << e;
      EXPECT_FALSE(has(e, "tensor-parallel group")) << "rank " << r << ": " << e;
    } else {
      EXPECT_TRUE(
          has(e, "rank 1 of the tensor-parallel group of rank 0 of the expert-parallel group "))
          << "rank " << r << ": " << e;
    }
  }
}

// TP rank 1 of ep rank 0 holds other tokens of the same shape: each TP rank
// would route its own and the partial outputs summed over tp would mix them.
TEST_P(MoeTpAgreement, OtherTokensOnOneTpRankAreRefusedOnEveryRank) {
  const Case k = GetParam();
  const auto errors = on_mesh([](const DeviceMesh& mesh, int e, int t) {
    MoE m(mesh, options());
    auto x = tokens(e);
    if (e == 0 && t == 1) x = x.flip(0);  // the same tokens in another order
    auto y = m(x);
    throw std::runtime_error("accepted; output sum " + std::to_string(y.sum().item<double>()));
  });
  for (int r = 0; r < k.world(); ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "hold different inputs")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "tp rank 0's and tp rank 1's")) << "rank " << r << ": " << e;
  }
}

// x.grad of ep rank e's tokens through a one-process layer with every
// parameter frozen, the loss sum(y) + the auxiliary loss.
torch::Tensor one_process_input_grad(int e) {
  MoE m(options());
  for (auto& p : m->parameters()) p.requires_grad_(false);
  auto x = tokens(e).requires_grad_();
  (m(x).sum() + m->aux_loss()).backward();
  return x.grad();
}

// Every parameter frozen, the input requires grad on world rank 0 alone:
// the exchanges' backward (ep) and the tp all-reduce of the rows' gradient
// must run on every rank (each calls backward where its loss requires grad),
// and rank 0's gradient be one process's. Each rank's error, kNoError where
// it passed.
std::vector<std::string> frozen_with_input_grad_on_rank_0(const std::string& backend, int ep,
                                                          int tp) {
  const auto want = one_process_input_grad(0);
  return errors_on_every_rank(
      ep * tp,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int e = world->rank() / tp;
        MoE m(init_device_mesh(world, {ep, tp}, {"ep", "tp"}), options());
        for (auto& p : m->parameters()) p.requires_grad_(false);
        auto x = tokens(e).requires_grad_(world->rank() == 0);
        auto loss = m(x).sum() + m->aux_loss();
        if (loss.requires_grad()) loss.backward();
        if (world->rank() == 0) {
          const double diff = (x.grad() - want).abs().max().item<double>();
          if (diff > 1e-5) throw std::runtime_error("input grad off by " + std::to_string(diff));
        }
      },
      briefly(backend));
}

TEST_P(MoeTpAgreement, FrozenParametersInputGradOnOneRankMatchesOneProcess) {
  const Case k = GetParam();
  const auto errors = frozen_with_input_grad_on_rank_0(k.backend, k.ep, k.tp);
  for (int r = 0; r < k.world(); ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], kNoError) << "rank " << r;
  }
}

// The same over ep alone, at ep 1 (nothing to join), 2 and 3.
class MoeFrozenOverEp : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeFrozenOverEp, InputGradOnOneRankMatchesOneProcess) {
  for (int ep : {1, 2, 3}) {
    const auto errors = frozen_with_input_grad_on_rank_0(GetParam(), ep, 1);
    for (int r = 0; r < ep; ++r) {
      EXPECT_EQ(errors[static_cast<size_t>(r)], kNoError) << "ep " << ep << ", rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeFrozenOverEp, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param; });

// Rank 1 runs forward under NoGradGuard while the parameters train: the
// others would wait for it in backward.
TEST_P(MoeTpAgreement, NoGradModeOnOneRankIsRefusedOnEveryRank) {
  const Case k = GetParam();
  const auto errors = on_mesh([](const DeviceMesh& mesh, int e, int t) {
    MoE m(mesh, options());
    std::optional<torch::NoGradGuard> off;
    if (e == 0 && t == 1) off.emplace();
    auto loss = m(tokens(e)).sum();
    if (loss.requires_grad()) loss.backward();
  });
  for (int r = 0; r < k.world(); ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "without grad mode")) << "rank " << r << ": " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeTpAgreement, ::testing::ValuesIn(cases()), case_name);

// device_content_digest, the digest the tp agreement takes of a tensor off
// the CPU, run here on test_device(): its two sums against the closed form
// sum_i w_i * m(i) modulo 2^64 in plain unsigned arithmetic, and a change
// of any one element, or a swap of two, changing both.
std::array<uint64_t, 2> closed_form(const std::vector<int64_t>& w) {
  const uint64_t k1 = 0x9E3779B97F4A7C15ULL, k2 = 0xC2B2AE3D27D4EB4FULL;
  std::array<uint64_t, 2> sums{0, 0};
  for (uint64_t i = 0; i < w.size(); ++i) {
    sums[0] += static_cast<uint64_t>(w[i]) * ((i * k1 + k2) | 1);
    sums[1] += static_cast<uint64_t>(w[i]) * (((i ^ k1) * k2) | 1);
  }
  return sums;
}

std::array<uint64_t, 2> digest_of(const torch::Tensor& t) {
  const auto d = device_content_digest(t.to(test_device()));
  return {static_cast<uint64_t>(d[0]), static_cast<uint64_t>(d[1])};
}

TEST(MoeDigest, SumsAreTheClosedFormOfTheElementsAsIntegers) {
  // int32 words as the element's bits; float32 shares int32's width.
  auto ints = torch::tensor({7, -3, 0, 2147483647, -2147483647 - 1, 12345}, torch::kInt32);
  const std::vector<int64_t> w(ints.data_ptr<int32_t>(), ints.data_ptr<int32_t>() + ints.numel());
  EXPECT_EQ(digest_of(ints), closed_form(w));
  auto floats = torch::tensor({1.5f, -2.0f, 0.0f}, torch::kFloat32);
  std::vector<int64_t> bits;
  for (int i = 0; i < 3; ++i) bits.push_back(floats.view(torch::kInt32)[i].item<int32_t>());
  EXPECT_EQ(digest_of(floats), closed_form(bits));
  EXPECT_EQ(digest_of(torch::zeros({0, 4})), closed_form({}));
}

TEST(MoeDigest, AnyOneElementChangedOrTwoSwappedChangesBothSums) {
  auto gen = at::detail::createCPUGenerator(5);
  // float32 over 2^22 elements, so that a change lands in the second slice.
  for (auto dtype :
       {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kInt8, torch::kBool}) {
    SCOPED_TRACE(c10::toString(dtype));
    const int64_t n = dtype == torch::kFloat32 ? (int64_t{1} << 22) + 9 : 1001;
    const auto base = (torch::randn({n}, gen) * 3).to(dtype);
    const auto want = digest_of(base);
    EXPECT_EQ(digest_of(base.clone()), want) << "an equal copy";
    EXPECT_EQ(digest_of(torch::stack({base, base}, 1).select(1, 0)), want)
        << "a strided view of equal elements";
    for (int64_t i : {int64_t{0}, n / 2, std::min(n - 2, (int64_t{1} << 22) + 3), n - 1}) {
      auto changed = base.clone();
      changed[i] = dtype == torch::kBool ? torch::logical_not(base[i]) : base[i] + 1;
      const auto got = digest_of(changed);
      EXPECT_NE(got[0], want[0]) << "element " << i;
      EXPECT_NE(got[1], want[1]) << "element " << i;
    }
    auto swapped = base.clone();
    const int64_t a = 1, b = n - 2;
    if (!base[a].equal(base[b])) {
      swapped[a] = base[b];
      swapped[b] = base[a];
      EXPECT_NE(digest_of(swapped), want) << "elements " << a << " and " << b << " swapped";
    }
  }
}

}  // namespace
}  // namespace cohort::testing::moe_tp_agreement_test
