// The MoE at the edges of routing against one process holding every expert
// (the same seed, the ranks' tokens in turn), on ep x tp meshes of 1, 2, 3
// and 4 ranks, k = 1 and 2: a router that sends every token's first choice
// to expert 0 and leaves its second choice to a five-way tie (so the
// capacity drops most assignments, and unevenly), an ep rank with a batch of
// zero, and experts no token reaches on any rank. Outputs, dropped counts,
// the input's and router's gradients and every expert's gradient must be
// one process's, and an expert no token reaches has a zero gradient, defined
// on every rank (an undefined one on some ranks would leave the ranks'
// gradient averages apart).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <ostream>
#include <stdexcept>

#include "cohort/expert_parallel/moe.h"
#include "support/thread_ranks.h"

namespace cohort::testing::moe_routing_edges_test {
namespace {

using namespace cohort::expert_parallel;

constexpr int64_t kHidden = 4, kFfn = 4, kExperts = 6;
// Sequences of ep rank e (each of two tokens): ep rank 1 has none.
const std::vector<int64_t> kSequences = {3, 0, 2};

struct Case {
  std::string backend;
  int ep, tp;
  int64_t k;
};

std::vector<Case> cases() {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<Case> out;
  for (const auto& b : backends) {
    for (auto [ep, tp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{3, 1}, std::pair{2, 2}}) {
      for (int64_t k : {1, 2}) out.push_back({b, ep, tp, k});
    }
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return c.backend + "_ep" + std::to_string(c.ep) + "_tp" + std::to_string(c.tp) + "_k" +
         std::to_string(c.k);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " ep " << c.ep << " x tp " << c.tp << " k " << c.k;
}

MoEOptions options(int64_t k) {
  MoEOptions o;
  o.hidden = kHidden;
  o.ffn = kFfn;
  o.experts = kExperts;
  o.top_k = k;
  o.capacity_factor = 1.0;
  o.aux_loss_coef = 0.1;
  o.seed = 21;
  return o;
}

// Positive tokens and a router whose only nonzero row is expert 0's: every
// first choice is expert 0, every other logit is 0 (a tie).
void skew(MoE& m) {
  torch::NoGradGuard no_grad;
  m->router.zero_();
  m->router[0].fill_(1.0);
}
torch::Tensor tokens(int e) {
  auto gen = at::detail::createCPUGenerator(60 + static_cast<uint64_t>(e));
  return torch::rand({kSequences[static_cast<size_t>(e)], 2, kHidden}, gen) + 0.1;
}
torch::Tensor probe(int e) {
  auto gen = at::detail::createCPUGenerator(80 + static_cast<uint64_t>(e));
  return torch::randn({kSequences[static_cast<size_t>(e)], 2, kHidden}, gen);
}

struct Reference {
  MoE moe;
  std::vector<torch::Tensor> out, input_grad;
  std::vector<int64_t> dropped;
  Reference(int64_t k, int ranks) : moe(options(k)) {
    skew(moe);
    torch::Tensor loss = torch::zeros({});
    std::vector<torch::Tensor> xs;
    for (int e = 0; e < ranks; ++e) {
      xs.push_back(tokens(e).requires_grad_());
      auto y = moe(xs.back());
      out.push_back(y.detach());
      dropped.push_back(moe->dropped());
      loss = loss + (y * probe(e)).sum() + moe->aux_loss();
    }
    loss.backward();
    for (auto& x : xs) input_grad.push_back(x.grad());
  }
};

// Throws naming the first of `got` that is undefined or off `want`.
void check(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (!got.defined()) throw std::runtime_error(what + ": undefined");
  if (got.sizes() != want.sizes() || !torch::allclose(got, want, 1e-5, 1e-6)) {
    throw std::runtime_error(what + ": off one process's by " +
                             std::to_string((got - want).abs().max().item<double>()));
  }
}

class MoeRoutingEdges : public ::testing::TestWithParam<Case> {};

TEST_P(MoeRoutingEdges, MatchOneProcess) {
  const Case c = GetParam();
  const Reference ref(c.k, c.ep);
  int64_t dropped = 0;
  for (auto d : ref.dropped) dropped += d;
  EXPECT_GT(dropped, 0) << "the skewed router was meant to overflow expert 0's capacity";
  // Experts no token reaches on any rank: their reference gradient is zero.
  const auto reached = ref.moe->w1.grad().abs().sum({1, 2}).ne(0);
  EXPECT_LT(reached.sum().item<int64_t>(), kExperts) << "some expert was meant to get nothing";
  ThreadRanksOptions o;
  o.backend = c.backend;
  o.timeout = std::chrono::seconds(5);
  run_ranks_shared(
      c.ep * c.tp,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int e = world->rank() / c.tp, t = world->rank() % c.tp;
        auto mesh = init_device_mesh(world, {c.ep, c.tp}, {"ep", "tp"});
        MoE m(mesh, options(c.k));
        skew(m);
        auto x = tokens(e).requires_grad_();
        auto y = m(x);
        ((y * probe(e)).sum() + m->aux_loss()).backward();
        const auto at = static_cast<size_t>(e);
        EXPECT_EQ(m->dropped(), ref.dropped[at]);
        check(y, ref.out[at], "output");
        check(x.grad(), ref.input_grad[at], "input grad");
        auto router = m->router.grad().clone();
        mesh["ep"].process_group()->all_reduce(router).wait();
        check(router, ref.moe->router.grad(), "router grad (summed over ep)");
        const int64_t first = m->first_expert(), n = m->local_experts(), part = kFfn / c.tp;
        const auto& r = *ref.moe;
        check(m->w1.grad(), r.w1.grad().narrow(0, first, n).narrow(1, t * part, part), "w1 grad");
        check(m->b1.grad(), r.b1.grad().narrow(0, first, n).narrow(1, t * part, part), "b1 grad");
        check(m->w2.grad(), r.w2.grad().narrow(0, first, n).narrow(2, t * part, part), "w2 grad");
        check(m->b2.grad(), r.b2.grad().narrow(0, first, n), "b2 grad");
      },
      o);
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeRoutingEdges, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::moe_routing_edges_test
