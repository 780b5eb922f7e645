// Which parameters DDP keeps alike across ranks and which gradients it
// leaves, against one process of plain LibTorch, on every engine ranks as
// threads run on, at worlds 1 to 3.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <optional>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::parameters_test {
namespace {

using Case = EngineWorld;

std::vector<Case> cases() { return engine_worlds(); }

// Values drawn from `seed` alone (ranks are threads: no global generator).
torch::Tensor draw(uint64_t seed, at::IntArrayRef sizes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(sizes, gen);
}

void init_parameters(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(draw(seed++, p.sizes()) * 0.5);
}

// Each parameter's .grad (undefined where it has none).
std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.grad().defined() ? p.grad().detach().clone() : torch::Tensor());
  }
  return out;
}

// Same definedness, and values within `tolerance`.
void expect_grads(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                  const std::vector<std::string>& names, const std::string& where,
                  double tolerance = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!want[i].defined()) {
      EXPECT_FALSE(got[i].defined()) << where << ": '" << names[i] << "' has a gradient, "
                                     << "one process has none";
      continue;
    }
    ASSERT_TRUE(got[i].defined()) << where << ": '" << names[i] << "' has no gradient";
    EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), tolerance)
        << where << ": '" << names[i] << "'";
  }
}

class DdpParameters : public ::testing::TestWithParam<Case> {};

// ---- Parameters without requires_grad ----

// A frozen feature layer (drawn after a per-rank seed, as a program that
// seeds by rank draws it) under a trainable head; `extra` frozen elements
// in a vector of their own.
struct FrozenNetImpl : torch::nn::Module {
  torch::nn::Linear features{nullptr}, head{nullptr};
  torch::Tensor scale;
  explicit FrozenNetImpl(int64_t extra = 2) {
    features = register_module("features", torch::nn::Linear(4, 6));
    head = register_module("head", torch::nn::Linear(6, 2));
    scale = register_parameter("scale", torch::ones({extra}), /*requires_grad=*/false);
    for (auto& p : features->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::tanh(features(x))) * scale.sum();
  }
};
TORCH_MODULE(FrozenNet);

// Every rank ends with rank 0's frozen values, so the gradients are one
// process's on the whole batch from rank 0's model; frozen tensors whose
// shapes differ across ranks are a MismatchError on every rank.
TEST_P(DdpParameters, FrozenParametersAreRankZeros) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  constexpr int64_t kRows = 3;
  const auto x = draw(1, {c.world * kRows, 4}), y = draw(2, {c.world * kRows, 2});
  FrozenNet reference;
  init_parameters(*reference, 100);
  {
    torch::NoGradGuard no_grad;
    reference->scale.fill_(0.75);
  }
  const auto rank0 = clone_all(reference->parameters());
  torch::mse_loss(reference->forward(x), y).backward();
  const auto want = grads_of(reference->parameters());

  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        const int r = comm->rank();
        FrozenNet model;
        init_parameters(*model, 100 + 1000 * r);  // rank 0's is the reference's
        {
          torch::NoGradGuard no_grad;
          model->scale.fill_(0.75 + r);
        }
        DistributedDataParallel<FrozenNet> ddp(model, comm);
        const auto params = model->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_TRUE(torch::equal(params[i], rank0[i]))
              << "rank " << r << ": '" << names[i] << "' is not rank 0's";
        }
        torch::mse_loss(ddp.forward(x.narrow(0, r * kRows, kRows)), y.narrow(0, r * kRows, kRows))
            .backward();
        expect_grads(grads_of(params), want, names, "rank " + std::to_string(r));

        if (c.world == 1) return;
        // The last rank's frozen vector is longer; the trainable parameters match.
        FrozenNet other(r == c.world - 1 ? 3 : 2);
        try {
          DistributedDataParallel<FrozenNet> refused(other, comm);
          ADD_FAILURE() << "no error on rank " << r;
        } catch (const MismatchError& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("parameters without requires_grad"), std::string::npos) << m;
          EXPECT_NE(m.find("'scale'"), std::string::npos) << m;
          EXPECT_NE(m.find("[3] on rank " + std::to_string(c.world - 1)), std::string::npos) << m;
        }
      },
      options_for(c));
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

// Each tensor once (LibTorch's parameters() lists a tied one twice).
std::vector<torch::Tensor> distinct(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    bool seen = false;
    for (const auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

// L = 6 leaves of 2 rows each (the global batch is 12 rows at every world).
constexpr int64_t kLeaves = 6, kLeafRows = 2;

struct Mode {
  std::string name;
  Determinism determinism;
  bool bucket_view;
};

const std::vector<Mode> kModes = {
    {"default", Determinism::Default, true},
    {"default_own_grad", Determinism::Default, false},
    {"world_size_invariant", Determinism::WorldSizeInvariant, true},
    {"world_size_invariant_own_grad", Determinism::WorldSizeInvariant, false}};

DDPOptions options_of(const Mode& mode) {
  DDPOptions o;
  o.determinism = mode.determinism;
  o.leaves = kLeaves;
  o.gradient_as_bucket_view = mode.bucket_view;
  o.bucket_cap_mb = o.first_bucket_mb = 1e-4;  // several buckets
  return o;
}

// The tied weight gets the gradient of both its uses, as in one process, in
// every mode; DDP reduces it once.
TEST_P(DdpParameters, TiedWeightGetsItsWholeGradientInEveryMode) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const int64_t rows = kLeaves * kLeafRows;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto ids = torch::randint(10, {rows}, gen, torch::kLong);
  const auto y = draw(6, {rows, 10});
  TiedNet reference;
  init_parameters(*reference, 300);
  ASSERT_TRUE(reference->head->weight.is_same(reference->embedding->weight));
  const auto params = distinct(reference->parameters());
  ASSERT_EQ(params.size(), 3u);  // the tied weight, mid's weight and bias
  const auto init = clone_all(params);
  torch::mse_loss(reference->forward(ids), y).backward();
  const auto want = grads_of(params);
  const std::vector<std::string> names = {"embedding.weight", "mid.weight", "mid.bias"};

  for (const auto& mode : kModes) {
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          const int r = comm->rank();
          TiedNet model;
          const auto mine = distinct(model->parameters());
          {
            torch::NoGradGuard no_grad;
            for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(init[i]);
          }
          DistributedDataParallel<TiedNet> ddp(model, comm, options_of(mode));
          EXPECT_EQ(ddp.reducer().parameters().size(), 3u) << mode.name;
          for (int step = 0; step < 2; ++step) {  // the second reuses every buffer
            model->zero_grad(/*set_to_none=*/true);
            // One forward per leaf (WorldSizeInvariant) or over the rank's rows.
            const bool leaves = mode.determinism == Determinism::WorldSizeInvariant;
            const int64_t per_forward = leaves ? kLeafRows : rows / c.world;
            const int64_t first = leaves ? ddp.first_leaf() * kLeafRows : r * per_forward;
            const int64_t forwards = leaves ? ddp.local_leaves() : 1;
            for (int64_t k = 0; k < forwards; ++k) {
              const int64_t at = first + k * per_forward;
              torch::mse_loss(ddp.forward(ids.narrow(0, at, per_forward)),
                              y.narrow(0, at, per_forward))
                  .backward();
            }
            expect_grads(
                grads_of(mine), want, names,
                mode.name + ", rank " + std::to_string(r) + ", step " + std::to_string(step));
          }
        },
        options_for(c));
  }
}

// ---- A branch used in one no_sync() micro-batch on rank 0 only ----

// Two rounds of two micro-batches, the first under no_sync(), gradients set
// to none before each round. Round 0: only rank 0's first micro-batch uses
// the branch. Round 1: no micro-batch uses it. The branch's gradient is the
// average over the ranks of their accumulated gradients (missing ones count
// as zeros) on every rank in round 0, and undefined everywhere in round 1.
TEST_P(DdpParameters, BranchUsedInOneNoSyncMicroBatchIsAveragedOnEveryRank) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  constexpr int kRounds = 2, kMicro = 2;
  constexpr int64_t kRows = 4;
  auto uses_branch = [](int round, int micro, int rank) {
    return round == 0 && micro == 0 && rank == 0;
  };
  const auto xs = draw(3, {kRounds, kMicro, c.world, kRows, 8});
  const auto ys = draw(4, {kRounds, kMicro, c.world, kRows, 4});
  BranchNet reference;
  init_parameters(*reference, 200);
  const auto init = clone_all(reference->parameters());
  // want[round][i]: sum over ranks of each rank's accumulated gradient / world.
  std::vector<std::vector<torch::Tensor>> want(kRounds);
  for (int round = 0; round < kRounds; ++round) {
    want[round].resize(init.size());
    for (int r = 0; r < c.world; ++r) {
      reference->zero_grad(/*set_to_none=*/true);
      for (int m = 0; m < kMicro; ++m) {
        torch::mse_loss(reference->forward(xs[round][m][r], !uses_branch(round, m, r)),
                        ys[round][m][r])
            .backward();
      }
      const auto g = grads_of(reference->parameters());
      for (size_t i = 0; i < g.size(); ++i) {
        if (!g[i].defined()) continue;
        want[round][i] = want[round][i].defined() ? want[round][i] + g[i] : g[i];
      }
    }
    for (auto& w : want[round]) {
      if (w.defined()) w = w / c.world;
    }
  }
  ASSERT_TRUE(want[0][2].defined() && !want[1][2].defined()) << "the branch is parameter 2";

  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        const int r = comm->rank();
        BranchNet model;
        copy_parameters(*model, init);
        DDPOptions options;
        options.find_unused_parameters = true;
        DistributedDataParallel<BranchNet> ddp(model, comm, options);
        for (int round = 0; round < kRounds; ++round) {
          model->zero_grad(/*set_to_none=*/true);
          for (int m = 0; m < kMicro; ++m) {
            std::optional<NoSyncGuard> guard;
            if (m + 1 < kMicro) guard.emplace(ddp.no_sync());
            torch::mse_loss(ddp.forward(xs[round][m][r], !uses_branch(round, m, r)),
                            ys[round][m][r])
                .backward();
          }
          expect_grads(grads_of(model->parameters()), want[round], names,
                       "rank " + std::to_string(r) + ", round " + std::to_string(round));
        }
      },
      options_for(c));
}

// ---- WorldSizeInvariant: a parameter that no leaf uses ----

// BranchNet with the branch left out of every leaf, or used in leaf 0 only
// (on rank 0): as one process (and the default mode), the branch's .grad is
// undefined in the first case and the mean of the leaves' gradients (the
// others zeros) on every rank in the second, with find_unused_parameters
// or without.
TEST_P(DdpParameters, WorldSizeInvariantLeavesAnUnusedParameterWithoutGradient) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const auto xs = draw(7, {kLeaves, kLeafRows, 8});
  const auto ys = draw(8, {kLeaves, kLeafRows, 4});
  BranchNet reference;
  init_parameters(*reference, 400);
  const auto init = clone_all(reference->parameters());
  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());

  for (const bool used_in_leaf_0 : {false, true}) {
    auto skip = [&](int64_t leaf) { return !(used_in_leaf_0 && leaf == 0); };
    // One process: the leaves' gradients summed (missing ones as zeros) / L.
    std::vector<torch::Tensor> want(init.size());
    for (int64_t l = 0; l < kLeaves; ++l) {
      reference->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(reference->forward(xs[l], skip(l)), ys[l]).backward();
      const auto g = grads_of(reference->parameters());
      for (size_t i = 0; i < g.size(); ++i) {
        if (g[i].defined()) want[i] = want[i].defined() ? want[i] + g[i] : g[i];
      }
    }
    for (auto& w : want) {
      if (w.defined()) w = w / kLeaves;
    }
    ASSERT_EQ(want[2].defined(), used_in_leaf_0) << "the branch is parameter 2";

    for (const bool find_unused : {true, false}) {
      run_ranks_shared(
          c.world,
          [&](std::shared_ptr<Communicator> comm) {
            const int r = comm->rank();
            BranchNet model;
            copy_parameters(*model, init);
            DDPOptions options;
            options.determinism = Determinism::WorldSizeInvariant;
            options.leaves = kLeaves;
            options.find_unused_parameters = find_unused;
            DistributedDataParallel<BranchNet> ddp(model, comm, options);
            for (int step = 0; step < 2; ++step) {
              for (int64_t k = 0; k < ddp.local_leaves(); ++k) {
                const int64_t l = ddp.first_leaf() + k;
                torch::mse_loss(ddp.forward(xs[l], skip(l)), ys[l]).backward();
              }
              expect_grads(grads_of(model->parameters()), want, names,
                           std::string(used_in_leaf_0 ? "used in leaf 0" : "unused") +
                               (find_unused ? ", find_unused_parameters" : "") + ", rank " +
                               std::to_string(r) + ", step " + std::to_string(step));
            }
          },
          options_for(c));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpParameters, ::testing::ValuesIn(cases()), engine_world_name);

}  // namespace
}  // namespace cohort::testing::parameters_test
