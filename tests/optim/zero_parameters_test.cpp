// Which parameters ZeRO (stages 1 and 2, alone and over cohort DDP, in both
// determinism modes) and the fused optimizer step, against one process of
// plain LibTorch, on every engine ranks as threads run on, at worlds 1 to 3:
// a layer that no leaf uses keeps its values under AdamW's weight decay, and
// a weight tied between two modules (listed twice by LibTorch's
// parameters()) trains as the one tensor it is.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <functional>
#include <set>

#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::zero_parameters_test {
namespace {

using Case = EngineWorld;

std::vector<Case> cases() { return engine_worlds(); }

// Values drawn from `seed` alone (ranks are threads: no global generator).
torch::Tensor draw(uint64_t seed, at::IntArrayRef sizes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(sizes, gen);
}

// Each tensor once, in first-seen order (LibTorch's parameters() lists a
// tied one twice, and LibTorch's optimizers would then step it twice).
std::vector<torch::Tensor> distinct(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    bool seen = false;
    for (const auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

void set_all(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard no_grad;
  ASSERT_EQ(params.size(), values.size());
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

// Weight decay moves a parameter that an optimizer steps with a zero
// gradient, so a wrongly defined gradient shows.
const auto kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
constexpr int kSteps = 4;
// L = 6 leaves of 2 rows: the global batch is 12 rows at every world.
constexpr int64_t kLeaves = 6, kLeafRows = 2;
constexpr double kTinyBucketMb = 16.0 * 4 / (1024 * 1024);  // 16 floats
constexpr double kTolerance = 1e-5;

class ZeroParameters : public ::testing::TestWithParam<Case> {};

// ---- WorldSizeInvariant: a layer that no leaf uses ----

// OptimNet's `unused` layer takes part in no forward. One process over the
// 6 leaves (each leaf's loss its mean, the step's gradient their mean) never
// gives it a gradient, so AdamW skips it: it keeps its initial values,
// weight decay included, at stage 1 and 2.
TEST_P(ZeroParameters, WorldSizeInvariantLeavesAnUnusedLayerUnstepped) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const auto xs = draw(11, {kSteps, kLeaves, kLeafRows, 7});
  const auto ys = draw(12, {kSteps, kLeaves, kLeafRows, 1});
  OptimNet reference(/*with_unused=*/true);
  set_all(reference->parameters(), [&] {
    std::vector<torch::Tensor> v;
    uint64_t seed = 100;
    for (const auto& p : reference->parameters()) v.push_back(draw(seed++, p.sizes()) * 0.5);
    return v;
  }());
  const auto init = clone_all(reference->parameters());
  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());
  {
    torch::optim::AdamW opt(reference->parameters(), kAdamW);
    for (int s = 0; s < kSteps; ++s) {
      reference->zero_grad(/*set_to_none=*/true);
      for (int64_t l = 0; l < kLeaves; ++l) {
        (torch::mse_loss(reference->forward(xs[s][l]), ys[s][l]) / kLeaves).backward();
      }
      opt.step();
    }
  }
  const auto want = clone_all(reference->parameters());
  ASSERT_EQ(names[2], "unused.weight");
  ASSERT_TRUE(want[2].equal(init[2]) && want[3].equal(init[3]));
  ASSERT_GT(max_diff(want, init), 1e-3);

  for (const int stage : {1, 2}) {
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          const int r = comm->rank();
          OptimNet net(/*with_unused=*/true);
          set_all(net->parameters(), init);
          DDPOptions options;
          options.determinism = Determinism::WorldSizeInvariant;
          options.leaves = kLeaves;
          DistributedDataParallel<OptimNet> ddp(net, comm, options);
          ZeroOptions zo;
          zo.stage = stage;
          zo.determinism = Determinism::WorldSizeInvariant;
          zo.leaves = kLeaves;
          auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kAdamW, zo);
          for (int s = 0; s < kSteps; ++s) {
            zero->zero_grad();
            for (int64_t k = 0; k < ddp.local_leaves(); ++k) {
              const int64_t l = ddp.first_leaf() + k;
              torch::mse_loss(ddp.forward(xs[s][l]), ys[s][l]).backward();
            }
            zero->step();
          }
          const auto got = net->parameters();
          const std::string where =
              "stage " + std::to_string(stage) + ", rank " + std::to_string(r);
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), kTolerance)
                << where << ": '" << names[i] << "'";
          }
          EXPECT_TRUE(got[2].equal(init[2]) && got[3].equal(init[3]))
              << where << ": the unused layer moved";
        },
        options_for(c));
  }
}

// ---- A weight tied between two modules ----

// The output projection's weight is the embedding's (one tensor registered
// in two modules, listed twice by LibTorch's parameters()).
struct HeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit HeadImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor forward(const torch::Tensor& h) { return h.matmul(weight.t()); }
};
TORCH_MODULE(Head);

struct TiedNetImpl : torch::nn::Module {
  torch::nn::Embedding embedding{nullptr};
  torch::nn::Linear mid{nullptr};
  Head head{nullptr};
  TiedNetImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(10, 6));
    mid = register_module("mid", torch::nn::Linear(6, 6));
    head = register_module("head", Head(embedding->weight));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(torch::tanh(mid(embedding(ids)))); }
};
TORCH_MODULE(TiedNet);

// How the ranks train the tied model.
struct Way {
  std::string name;
  bool fused = false;  // FusedDistributedOptimizer alone (no ZeRO, no DDP)
  int stage = 1;
  bool ddp = false;  // over cohort DDP (make(ddp, ...)), else ZeRO alone
  Determinism determinism = Determinism::Default;
  double bucket_cap_mb = 25;  // one bucket; kTinyBucketMb: several
};

std::vector<Way> ways() {
  std::vector<Way> out = {{"fused", true}};
  for (int stage : {1, 2}) {
    for (double cap : {25.0, kTinyBucketMb}) {
      const std::string s = "stage " + std::to_string(stage) + (cap < 1 ? ", tiny buckets" : "");
      out.push_back({s + ", alone", false, stage, false, Determinism::Default, cap});
      out.push_back({s + ", ddp", false, stage, true, Determinism::Default, cap});
    }
    out.push_back({"stage " + std::to_string(stage) + ", ddp, world size invariant", false, stage,
                   true, Determinism::WorldSizeInvariant});
  }
  return out;
}

// Every way ends a few AdamW steps at one process's parameters, where AdamW
// steps each distinct tensor once with the gradient of both its uses.
TEST_P(ZeroParameters, TiedWeightTrainsAsOneProcess) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const int64_t rows = kLeaves * kLeafRows;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  const auto ids = torch::randint(10, {kSteps, rows}, gen, torch::kLong);
  const auto ys = draw(22, {kSteps, rows, 10});
  TiedNet reference;
  ASSERT_TRUE(reference->head->weight.is_same(reference->embedding->weight));
  ASSERT_EQ(reference->parameters().size(), 4u);  // the tied weight listed twice
  const auto params = distinct(reference->parameters());
  ASSERT_EQ(params.size(), 3u);  // the tied weight, mid's weight and bias
  {
    std::vector<torch::Tensor> v;
    for (size_t i = 0; i < params.size(); ++i) v.push_back(draw(300 + i, params[i].sizes()) * 0.5);
    set_all(params, v);
  }
  const auto init = clone_all(params);
  {
    torch::optim::AdamW opt(params, kAdamW);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::mse_loss(reference->forward(ids[s]), ys[s]).backward();
      opt.step();
    }
  }
  const auto want = clone_all(params);
  ASSERT_GT(max_diff(want, init), 1e-3);
  const std::vector<std::string> names = {"embedding.weight", "mid.weight", "mid.bias"};

  for (const auto& way : ways()) {
    // Each way is reported on its own, an error included.
    try {
      run_ranks_shared(
          c.world,
          [&](std::shared_ptr<Communicator> comm) {
            const int r = comm->rank();
            TiedNet model;
            const auto mine = distinct(model->parameters());
            set_all(mine, init);
            const bool leaves = way.determinism == Determinism::WorldSizeInvariant;
            std::unique_ptr<DistributedDataParallel<TiedNet>> ddp;
            std::unique_ptr<ZeroRedundancyOptimizer> zero;
            std::unique_ptr<FusedDistributedOptimizer> fused;
            if (way.fused) {
              fused =
                  std::make_unique<FusedDistributedOptimizer>(model->parameters(), comm, kAdamW);
            } else {
              ZeroOptions zo;
              zo.stage = way.stage;
              zo.bucket_cap_mb = way.bucket_cap_mb;
              zo.determinism = way.determinism;
              zo.leaves = kLeaves;
              if (way.ddp) {
                DDPOptions o;
                o.determinism = way.determinism;
                o.leaves = kLeaves;
                ddp = std::make_unique<DistributedDataParallel<TiedNet>>(model, comm, o);
                zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, kAdamW, zo);
              } else {
                zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(model->parameters(), comm,
                                                                          kAdamW, zo);
              }
            }
            auto loss = [&](int s, int64_t at, int64_t n) {
              auto x = ids[s].narrow(0, at, n);
              return torch::mse_loss(ddp ? ddp->forward(x) : model->forward(x),
                                     ys[s].narrow(0, at, n));
            };
            for (int s = 0; s < kSteps; ++s) {
              fused ? fused->zero_grad() : zero->zero_grad();
              if (leaves) {
                for (int64_t k = 0; k < ddp->local_leaves(); ++k) {
                  loss(s, (ddp->first_leaf() + k) * kLeafRows, kLeafRows).backward();
                }
              } else {
                const int64_t n = rows / c.world;
                loss(s, r * n, n).backward();
              }
              fused ? fused->step() : zero->step();
            }
            if (zero && r == 0) {
              // A checkpoint names the tied tensor's state under both names, as
              // DDP's with a LibTorch optimizer does (rank 0 holds its start).
              std::set<std::string> fqns;
              for (const auto& e : dcp::get_state_dict(*model, *zero).tensors) fqns.insert(e.fqn);
              for (const std::string name : {"embedding", "head"}) {
                EXPECT_EQ(fqns.count("optim." + name + ".weight.exp_avg"), 1u)
                    << way.name << ", rank " << r << ": " << name;
              }
            }
            zero.reset();  // before DDP, whose reduction it may hold
            const auto got = distinct(model->parameters());
            ASSERT_EQ(got.size(), want.size());
            ASSERT_TRUE(model->head->weight.is_same(model->embedding->weight)) << way.name;
            for (size_t i = 0; i < got.size(); ++i) {
              EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), kTolerance)
                  << way.name << ", rank " << r << ": '" << names[i] << "'";
            }
          },
          options_for(c));
    } catch (const std::exception& e) {
      ADD_FAILURE() << way.name << ": " << e.what();
    }
  }
}

// A tensor in two groups is refused on every rank, as PyTorch refuses it
// (within one group a tied tensor is simply taken once).
TEST(ZeroParametersErrors, ATensorInTwoGroupsIsRefused) {
  torch::set_num_threads(1);
  std::vector<std::string> errors(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    TiedNet model;
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{model->embedding->weight, model->mid->weight});
    groups.emplace_back(std::vector<torch::Tensor>{model->mid->bias, model->head->weight});
    try {
      ZeroRedundancyOptimizer::make<torch::optim::AdamW>(groups, comm, kAdamW);
    } catch (const InvalidArgument& e) {
      errors[comm->rank()] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("a parameter is in groups 0 and 1"), std::string::npos) << e;
  }
}

// One rank alone lists a tensor in two groups; the others list it once, so
// the layouts and values agree. Every rank refuses in the constructor's
// first collective, not that rank alone while the others wait for it in
// the next one.
class ZeroGroupsErrors : public ::testing::TestWithParam<Case> {};

// Runs `build` on every rank (`last`: this is the last rank, which alone
// builds differently); the last rank must say `last_says`, the others that
// it refused.
void expect_last_rank_refused(const Case& c,
                              const std::function<void(std::shared_ptr<Communicator>, bool)>& build,
                              const std::string& last_says) {
  const int last = c.world - 1;
  auto options = options_for(c);
  options.timeout = std::chrono::seconds(3);
  const auto errors = errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        build(comm, comm->rank() == last);
      },
      options);
  for (int r = 0; r < c.world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    const std::string want = r == last ? last_says : "rank " + std::to_string(last) + " refused";
    EXPECT_NE(e.find(want), std::string::npos) << "rank " << r << ": " << e;
  }
}

TEST_P(ZeroGroupsErrors, OneRanksTensorInTwoGroupsIsRefusedOnEveryRank) {
  expect_last_rank_refused(
      GetParam(),
      [](std::shared_ptr<Communicator> comm, bool last) {
        const auto a = draw(1, {4, 3}).requires_grad_(), b = draw(2, {3}).requires_grad_();
        const auto d = draw(3, {5}).requires_grad_();
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(std::vector<torch::Tensor>{a, b});
        groups.emplace_back(last ? std::vector<torch::Tensor>{d, a}
                                 : std::vector<torch::Tensor>{d});
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(groups, comm, kAdamW);
      },
      "a parameter is in groups 0 and 1");
}

// The same for what the constructor does not support (one rank's third
// tensor is float64): that rank's Unsupported, the others naming it.
TEST_P(ZeroGroupsErrors, OneRanksMixedDtypesAreRefusedOnEveryRank) {
  expect_last_rank_refused(
      GetParam(),
      [](std::shared_ptr<Communicator> comm, bool last) {
        auto d = draw(3, {5});
        if (last) d = d.to(torch::kFloat64);
        std::vector<torch::Tensor> params{draw(1, {4, 3}).requires_grad_(),
                                          draw(2, {3}).requires_grad_(), d.requires_grad_()};
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(params, comm, kAdamW);
      },
      "all parameters must share one dtype");
}

// The fused optimizer's constructor as well: a float64 tensor, or an
// undefined one, on one rank.
TEST_P(ZeroGroupsErrors, OneRanksMixedDtypesAreRefusedOnEveryRankByTheFusedOptimizer) {
  expect_last_rank_refused(
      GetParam(),
      [](std::shared_ptr<Communicator> comm, bool last) {
        auto d = draw(3, {5});
        if (last) d = d.to(torch::kFloat64);
        std::vector<torch::Tensor> params{draw(1, {4, 3}).requires_grad_(), d.requires_grad_()};
        FusedDistributedOptimizer fused(params, comm, kAdamW);
      },
      "parameters must be dense tensors of one floating dtype");
}

TEST_P(ZeroGroupsErrors, OneRanksUndefinedTensorIsRefusedOnEveryRankByTheFusedOptimizer) {
  expect_last_rank_refused(
      GetParam(),
      [](std::shared_ptr<Communicator> comm, bool last) {
        std::vector<torch::Tensor> params{draw(1, {4, 3}).requires_grad_(),
                                          draw(3, {5}).requires_grad_()};
        if (last) params[1] = torch::Tensor();
        FusedDistributedOptimizer fused(params, comm, kAdamW);
      },
      "parameters must be dense tensors");
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroGroupsErrors, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

INSTANTIATE_TEST_SUITE_P(Zero, ZeroParameters, ::testing::ValuesIn(cases()), engine_world_name);

}  // namespace
}  // namespace cohort::testing::zero_parameters_test
