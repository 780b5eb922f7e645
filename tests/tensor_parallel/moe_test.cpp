// The expert-parallel MoE layer at ep = 1..4 against one process holding all
// experts (the same layer without a group, same seed), which runs each rank's
// tokens in turn: outputs, input gradients, the router's gradient (summed
// over ranks) and each rank's expert gradients, with the auxiliary loss in
// the loss; k = 1 and 2, with a capacity that drops tokens and one that drops
// none. A negative control reroutes one token and must be caught by the same
// comparison; average_moe_gradients at dp 2 x ep 2 and dp 2 x ep 2 x tp 2
// against the mean loss, and refusing groups of the wrong sizes or, on the
// 3-D mesh, of the right sizes but the wrong ranks;
// route() against hand-worked routings, the capacity's rounding against
// Megatron-Core's; options that differ across ranks.
// With COHORT_TEST_DEVICE=cuda the layers and the tokens are on the GPU.
#include "cohort/expert_parallel/moe.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>

#include "support/rank_errors.h"
#include "support/test_device.h"

namespace cohort::testing::moe_test {
namespace {

using namespace cohort::expert_parallel;

constexpr int64_t kHidden = 6, kFfn = 10, kExperts = 12;
// Tokens of rank r: rank-dependent counts, and a rank without tokens.
const std::vector<int64_t> kTokens = {9, 4, 0, 7};

torch::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  return torch::randn(sizes, at::detail::createCPUGenerator(seed));
}
// Drawn on the CPU, kept on test_device(), where the layers are moved too.
torch::Tensor tokens_of(int rank) {
  return randn({kTokens[rank], kHidden}, 100 + rank).to(test_device());
}
// The loss of rank r is sum(y * probe_of(r)) + its auxiliary loss.
torch::Tensor probe_of(int rank) {
  return randn({kTokens[rank], kHidden}, 200 + rank).to(test_device());
}

std::vector<std::string> backends() {
  std::vector<std::string> out = {"gloo"};
#ifdef COHORT_WITH_UCX
  out.push_back("ucx");
#endif
  return out;
}

struct Param {
  std::string backend;
  int ep;
  int64_t k;
  bool drops;
};

MoEOptions options(int64_t k, bool drops, std::shared_ptr<Communicator> group) {
  MoEOptions o;
  o.hidden = kHidden;
  o.ffn = kFfn;
  o.experts = kExperts;
  o.top_k = k;
  // 0.5 leaves 1 or 2 slots per expert for these batches; E leaves T * k,
  // more than any expert can be asked for.
  o.capacity_factor = drops ? 0.5 : static_cast<double>(kExperts);
  o.aux_loss_coef = 0.1;
  o.seed = 3;
  o.ep_group = std::move(group);
  return o;
}

torch::Tensor or_zeros(const torch::Tensor& grad, const torch::Tensor& like) {
  return grad.defined() ? grad : torch::zeros_like(like);
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The one comparison every case (and the negative control) uses.
bool close(const torch::Tensor& got, const torch::Tensor& want) {
  return got.sizes() == want.sizes() && torch::allclose(got, want, 1e-5, 1e-5);
}
void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(close(got, want)) << what << ": max |diff| "
                                << (got - want).abs().max().item<float>();
}

// One process, ranks' tokens in turn; `weights[r]` scales rank r's loss.
struct Reference {
  MoE moe;
  std::vector<torch::Tensor> out, input_grad;
  std::vector<int64_t> dropped;
  std::vector<float> aux;
  Reference(int64_t k, bool drops, int ranks, std::vector<double> weights)
      : moe(options(k, drops, nullptr)) {
    moe->to(test_device());
    torch::Tensor loss = torch::zeros({}, test_device());
    std::vector<torch::Tensor> xs;
    for (int r = 0; r < ranks; ++r) {
      xs.push_back(tokens_of(r).requires_grad_());
      auto y = moe(xs.back());
      out.push_back(y.detach());
      dropped.push_back(moe->dropped());
      aux.push_back(moe->aux_loss().item<float>());
      loss = loss + ((y * probe_of(r)).sum() + moe->aux_loss()) * weights[static_cast<size_t>(r)];
    }
    loss.backward();
    for (auto& x : xs) input_grad.push_back(or_zeros(x.grad(), x));
  }
  // Expert weight gradients of experts [first, first + n).
  torch::Tensor grad(const torch::Tensor& p, int64_t first, int64_t n) const {
    return or_zeros(p.grad(), p).narrow(0, first, n);
  }
};

void expect_expert_grads(const MoE& m, const Reference& ref) {
  const auto first = m->first_expert(), n = m->local_experts();
  expect_close(or_zeros(m->w1.grad(), m->w1), ref.grad(ref.moe->w1, first, n), "w1 grad");
  expect_close(or_zeros(m->b1.grad(), m->b1), ref.grad(ref.moe->b1, first, n), "b1 grad");
  expect_close(or_zeros(m->w2.grad(), m->w2), ref.grad(ref.moe->w2, first, n), "w2 grad");
  expect_close(or_zeros(m->b2.grad(), m->b2), ref.grad(ref.moe->b2, first, n), "b2 grad");
}

ThreadRanksOptions on(const std::string& backend) {
  ThreadRanksOptions o;
  o.backend = backend;
  return o;
}

// The mesh form takes the "ep" and "tp" groups of a 2-D mesh: the layer is
// the one the options form builds over those groups.
TEST(MoeMesh, TakesTheEpAndTpDimensions) {
  run_ranks_shared(4, [](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {2, 2}, {"ep", "tp"});
    MoEOptions o;
    o.hidden = 4;
    o.ffn = 8;
    o.experts = 4;
    o.seed = 5;  // one seed: two unseeded layers differ
    MoE from_mesh(mesh, o);
    o.ep_group = mesh["ep"].process_group();
    o.tp_group = mesh["tp"].process_group();
    MoE from_groups(o);
    EXPECT_EQ(from_mesh->options().ep_group, o.ep_group);
    EXPECT_EQ(from_mesh->options().tp_group, o.tp_group);
    EXPECT_EQ(from_mesh->w1.sizes(), (std::vector<int64_t>{2, 4, 4}));  // [E/ep, F/tp, H]
    EXPECT_TRUE(torch::equal(from_mesh->w1, from_groups->w1));
  });
}

class ExpertParallel : public ::testing::TestWithParam<Param> {};

TEST_P(ExpertParallel, MatchesOneProcess) {
  const auto p = GetParam();
  const Reference ref(p.k, p.drops, p.ep, std::vector<double>(4, 1.0));
  int64_t dropped = 0;
  for (auto d : ref.dropped) dropped += d;
  if (p.drops) {
    EXPECT_GT(dropped, 0) << "the capacity factor was meant to drop assignments";
  } else {
    EXPECT_EQ(dropped, 0);
  }
  run_ranks_shared(
      p.ep,
      [&](std::shared_ptr<Communicator> g) {
        torch::set_num_threads(1);
        const int r = g->rank();
        // The mesh form (the groups in the options: the other tests).
        MoE m(DeviceMesh::from_group(g, "ep"), options(p.k, p.drops, nullptr));
        m->to(test_device());
        auto x = tokens_of(r).requires_grad_();
        auto y = m(x);
        ((y * probe_of(r)).sum() + m->aux_loss()).backward();
        EXPECT_EQ(m->dropped(), ref.dropped[static_cast<size_t>(r)]);
        EXPECT_NEAR(m->aux_loss().item<float>(), ref.aux[static_cast<size_t>(r)], 1e-6);
        expect_close(y, ref.out[static_cast<size_t>(r)], "output");
        expect_close(or_zeros(x.grad(), x), ref.input_grad[static_cast<size_t>(r)], "input grad");
        // The router is replicated; each rank's gradient covers its tokens.
        auto router = m->router.grad().clone();
        g->all_reduce(router).wait();
        expect_close(router, ref.moe->router.grad(), "router grad (summed over ep)");
        expect_expert_grads(m, ref);
      },
      on(p.backend));
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (const auto& b : backends()) {
    for (int ep : {1, 2, 3, 4}) {
      for (int64_t k : {1, 2}) {
        for (bool drops : {true, false}) out.push_back({b, ep, k, drops});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Moe, ExpertParallel, ::testing::ValuesIn(params()), [](const auto& info) {
  const auto& p = info.param;
  return p.backend + "_ep" + std::to_string(p.ep) + "_k" + std::to_string(p.k) +
         (p.drops ? "_drops" : "_nodrops");
});

// Capacity and claiming order against hand-worked routings.
TEST(ExpertRouting, CapacityDropsInClaimingOrder) {
  // k = 1, E = 4, T = 5, factor 1: C = ceil(5 / 4) = 2; tokens choose
  // experts 0, 0, 0, 1, 2, so token 2 (expert 0's third) is dropped.
  auto logits = torch::zeros({5, 4});
  for (int64_t t : {0, 1, 2}) logits[t][0] = 3;
  logits[3][1] = 3;
  logits[4][2] = 3;
  auto r = route(logits, 1, 1.0);
  EXPECT_EQ(r.capacity, 2);
  EXPECT_TRUE(torch::equal(r.expert, torch::tensor({0, 0, 0, 1, 2}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(r.kept, torch::tensor({true, true, false, true, true})));
  // f = (3, 1, 1, 0) / 5; P the mean softmax.
  auto f = torch::tensor({0.6, 0.2, 0.2, 0.0}, torch::kFloat32);
  auto want = (f * torch::softmax(logits, -1).mean(0)).sum() * 4;
  EXPECT_NEAR(load_balancing_loss(r).item<float>(), want.item<float>(), 1e-6);

  // k = 2, E = 3, T = 2, factor 0.75: C = ceil(0.75 * 4 / 3) = 1. Token 0
  // chooses 0 then 1, token 1 chooses 1 then 2. First choices claim first,
  // so token 1's first choice keeps expert 1 and token 0's second is dropped.
  auto two = torch::tensor({{2.0, 1.0, 0.0}, {0.0, 2.0, 1.0}});
  auto q = route(two, 2, 0.75);
  EXPECT_EQ(q.capacity, 1);
  EXPECT_TRUE(torch::equal(q.expert, torch::tensor({0, 1, 1, 2}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(q.token, torch::tensor({0, 1, 0, 1}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(q.kept, torch::tensor({true, true, false, true})));
  // k = 2 gates are renormalized: each token's two sum to one.
  auto sums = torch::zeros({2}).index_add(0, q.token, q.gate.detach());
  EXPECT_TRUE(torch::allclose(sums, torch::ones({2})));
  // No tokens: no capacity, a zero loss.
  auto none = route(torch::zeros({0, 3}), 2, 1.0);
  EXPECT_EQ(none.capacity, 0);
  EXPECT_EQ(load_balancing_loss(none).item<float>(), 0.0f);
}

// The load-balancing loss over a sequence group (context parallelism): the
// ranks hold 5, then 3 + 2, then 3 + 0 + 2 tokens of one batch (one rank
// without tokens). Every rank's value is one process's over all of them;
// each rank's gradient, averaged over the group (divided by its size), is
// one process's gradient of its rows.
TEST(ExpertRouting, LoadBalancingLossOverASequenceGroup) {
  const auto logits = torch::randn({5, 4}, at::detail::createCPUGenerator(3));
  auto all = logits.clone().requires_grad_(true);
  auto want = load_balancing_loss(route(all, 2, 1.0));
  want.backward();
  const std::vector<std::vector<int64_t>> splits = {{5}, {3, 2}, {3, 0, 2}};
  for (const auto& rows : splits) {
    const int n = static_cast<int>(rows.size());
    run_ranks_shared(n, [&](std::shared_ptr<Communicator> g) {
      int64_t first = 0;
      for (int r = 0; r < g->rank(); ++r) first += rows[static_cast<size_t>(r)];
      const auto mine = rows[static_cast<size_t>(g->rank())];
      auto local = logits.narrow(0, first, mine).clone().requires_grad_(true);
      auto got = load_balancing_loss(route(local, 2, 1.0), *g);
      EXPECT_NEAR(got.item<float>(), want.item<float>(), 1e-6) << "cp " << n;
      got.backward();
      const auto expected = all.grad().narrow(0, first, mine);
      EXPECT_TRUE(torch::allclose(local.grad() / n, expected, 1e-5, 1e-7))
          << "cp " << n << ", rank " << g->rank() << ": " << local.grad() / n << " against "
          << expected;
    });
  }
}

// The capacity in Megatron-Core's order (get_capacity: ceil((T * k / E) *
// factor) in doubles), closed forms where the two orders of the product
// land on either side of an integer: in doubles (90 / 3) * 1.1 is exactly
// 33 while 1.1 * 90 / 3 is 33.00000000000001 (ceil 34); (150 / 3) * 1.1 is
// 55.00000000000001 (ceil 56) while 1.1 * 150 / 3 is 55.
TEST(ExpertRouting, CapacityRoundsAsMegatronCore) {
  EXPECT_EQ(expert_capacity(1.1, 90, 1, 3), 33);
  EXPECT_EQ(expert_capacity(1.1, 45, 2, 3), 33);  // T * k = 90 too
  EXPECT_EQ(expert_capacity(1.1, 150, 1, 3), 56);
  EXPECT_EQ(expert_capacity(1.1, 75, 2, 3), 56);
  EXPECT_EQ(expert_capacity(1.1, 180, 1, 3), 66);
  EXPECT_EQ(expert_capacity(1.1, 270, 1, 3), 100);
  // Exact in any order.
  EXPECT_EQ(expert_capacity(1.25, 8, 2, 4), 5);
  EXPECT_EQ(expert_capacity(1.0, 12, 1, 4), 3);
  EXPECT_EQ(expert_capacity(0.5, 7, 1, 4), 1);  // ceil(0.875)
}

// A capacity factor too large for an int64 capacity (the largest double,
// say, for "drop nothing") keeps every assignment: C is at most T * k.
TEST(ExpertRouting, HugeCapacityFactorDropsNothing) {
  const double largest = std::numeric_limits<double>::max();
  EXPECT_EQ(expert_capacity(largest, 5, 1, 4), 5);
  EXPECT_EQ(expert_capacity(1e19, 12, 1, 12), 12);
  EXPECT_EQ(expert_capacity(largest, 3, 2, 4), 6);
  EXPECT_EQ(expert_capacity(largest, 0, 2, 4), 0);
  auto logits = torch::zeros({5, 4});
  for (int64_t t = 0; t < 5; ++t) logits[t][0] = 3;  // every token wants expert 0
  auto r = route(logits, 1, largest);
  EXPECT_EQ(r.capacity, 5);
  EXPECT_TRUE(r.kept.all().item<bool>());
}

class ExpertParallelChecks : public ::testing::TestWithParam<std::string> {};

// A token sent to an expert other than the router's choice must fail the
// comparison above: the golden test can see a wrong dispatch.
TEST_P(ExpertParallelChecks, RerouteOneTokenIsCaught) {
  const Reference ref(1, false, 2, std::vector<double>(4, 1.0));
  run_ranks_shared(
      2,
      [&](std::shared_ptr<Communicator> g) {
        torch::set_num_threads(1);
        const int r = g->rank();
        MoE m(options(1, false, g));
        m->to(test_device());
        auto x = tokens_of(r);
        auto routing = m->route(x);
        // Token 0 of rank 0 goes to the matching expert of the other rank.
        if (r == 0) routing.expert[0] = (routing.expert[0].item<int64_t>() + 6) % kExperts;
        auto y = m->forward_routed(x, routing);
        const auto& want = ref.out[static_cast<size_t>(r)];
        EXPECT_EQ(close(y, want), r != 0);
        if (r == 0) {
          EXPECT_FALSE(close(y[0], want[0]));
          EXPECT_TRUE(close(y.narrow(0, 1, kTokens[0] - 1), want.narrow(0, 1, kTokens[0] - 1)));
        }
      },
      on(GetParam()));
}

// Rank 1's input needs no gradient, rank 0's does: both ranks still join
// the backward exchanges, and the gradients are one process's. With the
// router frozen, the dispatch exchange's backward must still run on rank 1
// (its rows need no gradient there, nor does the router).
void input_without_gradient_on_one_rank(const std::string& backend, bool frozen_router) {
  const Reference ref(1, false, 2, std::vector<double>(4, 1.0));
  auto o = on(backend);
  o.timeout = std::chrono::seconds(5);
  run_ranks_shared(
      2,
      [&](std::shared_ptr<Communicator> g) {
        torch::set_num_threads(1);
        const int r = g->rank();
        MoE m(options(1, false, g));
        m->to(test_device());
        if (frozen_router) m->router.requires_grad_(false);
        auto x = tokens_of(r).requires_grad_(r == 0);
        auto y = m(x);
        ((y * probe_of(r)).sum() + m->aux_loss()).backward();
        if (r == 0) expect_close(x.grad(), ref.input_grad[0], "input grad");
        expect_expert_grads(m, ref);
      },
      o);
}

TEST_P(ExpertParallelChecks, InputWithoutGradientOnOneRank) {
  input_without_gradient_on_one_rank(GetParam(), false);
}

TEST_P(ExpertParallelChecks, InputWithoutGradientOnOneRankUnderAFrozenRouter) {
  input_without_gradient_on_one_rank(GetParam(), true);
}

// dp 2 x ep 2 on 4 ranks, the loss the mean of the four ranks' losses: after
// average_moe_gradients every rank's gradients equal one process's.
TEST_P(ExpertParallelChecks, AverageGradientsOverDataAndExpertGroups) {
  const Reference ref(2, true, 4, std::vector<double>(4, 0.25));
  run_ranks_shared(
      4,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int r = world->rank();
        auto ep = world->split(r / 2, r);        // {0, 1}, {2, 3}
        auto replicas = world->split(r % 2, r);  // {0, 2}, {1, 3}: the same experts
        MoE m(options(2, true, ep));
        m->to(test_device());
        auto x = tokens_of(r).requires_grad_();
        auto y = m(x);
        ((y * probe_of(r)).sum() + m->aux_loss()).backward();
        average_moe_gradients(*m, *world, *replicas);
        expect_close(m->router.grad(), ref.moe->router.grad(), "router grad");
        expect_expert_grads(m, ref);
        EXPECT_EQ(expert_parameters(*m).size(), 4u);
        EXPECT_EQ(non_expert_parameters(*m).size(), 1u);
      },
      on(GetParam()));
}

// The ep group passed as expert_replicas (dp 2 x ep 2): averaging would mix
// experts 0-5 with 6-11. Every rank refuses, none waits in the average.
TEST_P(ExpertParallelChecks, ReplicasHoldingOtherExpertsAreRefused) {
  auto o = on(GetParam());
  o.timeout = std::chrono::seconds(5);
  auto errors = errors_on_every_rank(
      4,
      [](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int r = world->rank();
        auto ep = world->split(r / 2, r);
        MoE m(options(2, true, ep));
        m->to(test_device());
        auto y = m(tokens_of(r));
        ((y * probe_of(r)).sum() + m->aux_loss()).backward();
        average_moe_gradients(*m, *world, *ep);
      },
      o);
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_TRUE(has(errors[r], "average_moe_gradients (rank " + std::to_string(r) + " of 4)"))
        << errors[r];
    EXPECT_TRUE(has(errors[r], "holds different experts")) << errors[r];
  }
  // The group's own ranks name both values.
  EXPECT_TRUE(has(errors[0], "the first's first_expert() 0")) << errors[0];
  EXPECT_TRUE(has(errors[0], "the first's first_expert() 6")) << errors[0];
}

// dp 2 x ep 2 with groups that do not hold dp x ep = expert_replicas x ep
// ranks: (A) the dp group as both, so each ep rank's router is averaged over
// dp only (the ep ranks drift apart) and the expert gradients come out ep
// times too large; (B) every rank its own replica group while dp is 2, so
// the experts are never averaged over dp. Both are refused on every rank,
// none waits in the average; accepted, each rank's gradients against one
// process's are the figures in the failure.
void expect_group_sizes_refused(const std::string& backend, bool replicas_of_one) {
  const Reference ref(2, true, 4, std::vector<double>(4, 0.25));
  auto o = on(backend);
  o.timeout = std::chrono::seconds(5);
  auto errors = errors_on_every_rank(
      4,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int r = world->rank();
        auto ep = world->split(r / 2, r);  // {0, 1}, {2, 3}
        auto dp = world->split(r % 2, r);  // {0, 2}, {1, 3}: the same experts
        auto self = world->split(r, 0);
        MoE m(options(2, true, ep));
        m->to(test_device());
        auto y = m(tokens_of(r));
        ((y * probe_of(r)).sum() + m->aux_loss()).backward();
        average_moe_gradients(*m, replicas_of_one ? *world : *dp, replicas_of_one ? *self : *dp);
        const auto w1 = ref.grad(ref.moe->w1, m->first_expert(), m->local_experts());
        throw std::runtime_error(
            "accepted; router grad off by " +
            std::to_string((m->router.grad() - ref.moe->router.grad()).abs().max().item<float>()) +
            ", w1 grad " + std::to_string((m->w1.grad().norm() / w1.norm()).item<float>()) +
            " times one process's");
      },
      o);
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_TRUE(has(e, "average_moe_gradients (rank ")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, replicas_of_one ? "has 4 ranks, not the expert_replicas group's 1 times"
                                       : "has 2 ranks, not the expert_replicas group's 2 times"))
        << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "the 2 of the expert-parallel group of the MoE")) << e;
  }
}

TEST_P(ExpertParallelChecks, ReplicasPassedAsTheDenseGroupAreRefused) {
  expect_group_sizes_refused(GetParam(), false);
}

TEST_P(ExpertParallelChecks, OneRankReplicasWhileDpIsTwoAreRefused) {
  expect_group_sizes_refused(GetParam(), true);
}

// dp 2 x ep 2 x tp 2 on 8 ranks (tokens by dp x ep, the same on both tp
// ranks), the loss the mean of the four dense ranks' losses.
enum class Groups { Right, World, DpTp };

// Rank's part of the one-process gradient of `p`: its experts, and its TP
// slice of the FFN (dim `split`; -1 for none).
torch::Tensor tp_part(const torch::Tensor& p, const MoE& m, int64_t split) {
  auto g = or_zeros(p.grad(), p).narrow(0, m->first_expert(), m->local_experts());
  if (split < 0) return g;
  const auto& tp = *m->options().tp_group;
  const int64_t part = g.size(split) / tp.size();
  return g.narrow(split, tp.rank() * part, part);
}

// With the right groups (dense {dp, ep}, replicas dp) every rank's
// gradients equal its part of one process's. With (A) the whole world as
// dense and {dp, tp} as replicas, different TP slices of w1 would be
// averaged together; with (B) {dp, tp} as dense, each ep rank's router
// would drift apart. Both have the right sizes and are refused on every
// rank; accepted, how far each rank's gradients fall from the right
// groups' is the figure in the failure.
void average_over_the_mesh(const std::string& backend, Groups groups) {
  const Reference ref(2, true, 4, std::vector<double>(4, 0.25));
  auto o = on(backend);
  o.timeout = std::chrono::seconds(5);
  auto errors = errors_on_every_rank(
      8,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {2, 2, 2}, {"dp", "ep", "tp"});
        const int r = mesh.local_rank("dp") * 2 + mesh.local_rank("ep");
        MoE m(mesh, options(2, true, nullptr));
        m->to(test_device());
        auto y = m(tokens_of(r));
        ((y * probe_of(r)).sum() + m->aux_loss()).backward();
        std::vector<torch::Tensor> raw;
        for (const auto& p : m->parameters()) raw.push_back(p.grad().clone());
        average_moe_gradients(*m, *mesh[{"dp", "ep"}].process_group(), *mesh["dp"].process_group());
        if (groups == Groups::Right) {
          expect_close(m->router.grad(), ref.moe->router.grad(), "router grad");
          expect_close(m->w1.grad(), tp_part(ref.moe->w1, m, 1), "w1 grad");
          expect_close(m->b1.grad(), tp_part(ref.moe->b1, m, 1), "b1 grad");
          expect_close(m->w2.grad(), tp_part(ref.moe->w2, m, 2), "w2 grad");
          expect_close(m->b2.grad(), tp_part(ref.moe->b2, m, -1), "b2 grad");
          throw std::runtime_error("accepted");
        }
        const auto router = m->router.grad().clone(), w1 = m->w1.grad().clone();
        auto params = m->parameters();
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad().copy_(raw[i]);
        if (groups == Groups::World) {
          average_moe_gradients(*m, *world, *mesh[{"dp", "tp"}].process_group());
        } else {
          average_moe_gradients(*m, *mesh[{"dp", "tp"}].process_group(),
                                *mesh["dp"].process_group());
        }
        throw std::runtime_error(
            "accepted; w1 grad off the right groups' by " +
            std::to_string((m->w1.grad() - w1).abs().max().item<float>()) + " (largest " +
            std::to_string(w1.abs().max().item<float>()) + "), router grad by " +
            std::to_string((m->router.grad() - router).abs().max().item<float>()));
      },
      o);
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    if (groups == Groups::Right) {
      EXPECT_EQ(e, "accepted") << "rank " << r;
      continue;
    }
    EXPECT_TRUE(has(e, "average_moe_gradients (rank ")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e,
                    "pass as dense the ranks that see different tokens, mesh[{\"dp\", \"ep\", "
                    "\"cp\"}] (one TP rank)"))
        << "rank " << r << ": " << e;
    if (groups == Groups::World) {
      EXPECT_TRUE(has(e, "different TP ranks' parts")) << "rank " << r << ": " << e;
    } else {
      EXPECT_TRUE(has(e, "holds different TP ranks' parts of the experts (")) << e;
      EXPECT_TRUE(has(e, "holds the ep ranks unevenly (")) << "rank " << r << ": " << e;
      EXPECT_TRUE(has(e, "not each of the 2 ep ranks 2 times")) << "rank " << r << ": " << e;
    }
  }
}

TEST_P(ExpertParallelChecks, AverageOverTheMeshsDataAndExpertGroups) {
  average_over_the_mesh(GetParam(), Groups::Right);
}

TEST_P(ExpertParallelChecks, WholeWorldAsDenseWithTensorParallelReplicasIsRefused) {
  average_over_the_mesh(GetParam(), Groups::World);
}

TEST_P(ExpertParallelChecks, DataAndTensorParallelAsDenseIsRefused) {
  average_over_the_mesh(GetParam(), Groups::DpTp);
}

INSTANTIATE_TEST_SUITE_P(Moe, ExpertParallelChecks, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param; });

MoEOptions small(std::shared_ptr<Communicator> g, int64_t experts, int64_t k) {
  MoEOptions o;
  o.hidden = 4;
  o.ffn = 8;
  o.experts = experts;
  o.top_k = k;
  o.ep_group = std::move(g);
  return o;
}

// A rank left waiting reports a timeout within seconds, never the error
// a case expects.
ThreadRanksOptions briefly_on(const std::string& backend) {
  auto o = on(backend);
  o.timeout = std::chrono::seconds(3);
  return o;
}

void expect_on_every_rank(const std::vector<std::string>& errors,
                          const std::vector<std::string>& parts) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_TRUE(has(errors[r], "MoE (rank " + std::to_string(r) + " of ")) << errors[r];
    for (const auto& part : parts) EXPECT_TRUE(has(errors[r], part)) << errors[r];
  }
}

// Options that cannot make one layer across the ep group: an exception on
// every rank naming the problem (and, for options that differ, both ranks
// and both values), never a hang or a layer built from mismatched halves.
class MoeErrors : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeErrors, ExpertsNotDivisibleByEp) {
  auto errors = errors_on_every_rank(
      3, [](std::shared_ptr<Communicator> g) { MoE m(small(g, 8, 1)); }, briefly_on(GetParam()));
  expect_on_every_rank(errors, {"8 experts do not divide by the expert-parallel size 3"});
}

// Rank 1 would also fail the divisibility check alone; the agreement comes
// first, so every rank names the real cause.
TEST_P(MoeErrors, ExpertCountsDiffer) {
  auto errors = errors_on_every_rank(
      3, [](std::shared_ptr<Communicator> g) { MoE m(small(g, g->rank() == 1 ? 10 : 12, 1)); },
      briefly_on(GetParam()));
  expect_on_every_rank(
      errors, {"experts differs across the expert-parallel group", "rank 0 has 12, rank 1 has 10"});
}

TEST_P(MoeErrors, TopKDiffers) {
  auto errors = errors_on_every_rank(
      3, [](std::shared_ptr<Communicator> g) { MoE m(small(g, 6, g->rank() == 2 ? 2 : 1)); },
      briefly_on(GetParam()));
  expect_on_every_rank(
      errors, {"top_k differs across the expert-parallel group", "rank 0 has 1, rank 2 has 2"});
}

// The TP ranks of one expert must route alike: options that differ there
// are refused as over ep, naming the tensor-parallel group.
TEST_P(MoeErrors, SeedDiffersAcrossTensorParallel) {
  auto errors = errors_on_every_rank(
      2,
      [](std::shared_ptr<Communicator> g) {
        MoEOptions o = small(nullptr, 4, 1);
        o.seed = g->rank() == 1 ? 8 : 7;
        o.tp_group = g;
        MoE m(o);
      },
      briefly_on(GetParam()));
  expect_on_every_rank(
      errors, {"seed differs across the tensor-parallel group", "rank 0 has 7, rank 1 has 8"});
}

TEST_P(MoeErrors, AuxLossCoefficientDiffers) {
  auto errors = errors_on_every_rank(
      3,
      [](std::shared_ptr<Communicator> g) {
        MoEOptions o = small(g, 6, 1);
        if (g->rank() == 2) o.aux_loss_coef = 0.02;
        MoE m(o);
      },
      briefly_on(GetParam()));
  expect_on_every_rank(errors, {"aux_loss_coef differs across the expert-parallel group",
                                "rank 0 has 0.01", "rank 2 has 0.02"});
}

TEST_P(MoeErrors, TopKOutOfRange) {
  auto errors = errors_on_every_rank(
      2, [](std::shared_ptr<Communicator> g) { MoE m(small(g, 4, 3)); }, briefly_on(GetParam()));
  expect_on_every_rank(errors, {"top_k must be 1 or 2, got 3"});
}

TEST_P(MoeErrors, InputOfAnotherWidth) {
  auto errors = errors_on_every_rank(
      2,
      [](std::shared_ptr<Communicator> g) {
        MoE m(small(g, 4, 1));
        m(torch::zeros({3, 5}));
      },
      briefly_on(GetParam()));
  expect_on_every_rank(errors,
                       {"this rank's input: the input's last dimension must be hidden = 4, got 5"});
}

// Only rank 1's input is bad (another width, or another dtype than the
// parameters'): it cannot route, and throwing there alone would leave the
// others in the count exchange. The refusal rides in that exchange, so
// every rank throws naming rank 1 and why, at world 2 and 3.
void expect_one_bad_rank_named(const std::string& backend, bool wide) {
  for (int world : {2, 3}) {
    auto errors = errors_on_every_rank(
        world,
        [&](std::shared_ptr<Communicator> g) {
          MoE m(small(g, 6, 1));
          auto x = torch::zeros({3, 4});
          if (g->rank() == 1) x = wide ? torch::zeros({3, 5}) : x.to(torch::kFloat64);
          m(x);
        },
        briefly_on(backend));
    const std::string why = wide ? "the input's last dimension must be hidden = 4, got 5"
                                 : "the input is Double, the MoE's parameters Float";
    expect_on_every_rank(errors, {why});
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_TRUE(
          has(errors[r], r == 1 ? "this rank's input: " : "rank 1 of the expert-parallel group "))
          << "world " << world << ": " << errors[r];
    }
  }
}

TEST_P(MoeErrors, InputOfAnotherWidthOnOneRank) { expect_one_bad_rank_named(GetParam(), true); }

TEST_P(MoeErrors, InputOfAnotherDtypeOnOneRank) { expect_one_bad_rank_named(GetParam(), false); }

TEST_P(MoeErrors, GroupsFromBothTheMeshAndTheOptions) {
  auto errors = errors_on_every_rank(
      2,
      [](std::shared_ptr<Communicator> g) {
        MoE m(DeviceMesh::from_group(g, "ep"), small(g, 4, 1));
      },
      briefly_on(GetParam()));
  expect_on_every_rank(errors,
                       {"from the mesh or from ep_group/tp_group/sequence_group, not both"});
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeErrors, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace cohort::testing::moe_test
