// GradientSynchronizer on a DeviceMesh: the embedding group it splits from
// the "pp" group joins exactly the first and the last stage (closed form,
// and an all-reduce over it sums exactly their values), synchronize() leaves
// a parameter no rank has a gradient for undefined and averages (or sums)
// one some ranks have with zeros from the others, in each dimension (closed
// forms), and a mesh it cannot reduce over is an InvalidArgument on every
// rank naming the dimension. An untied model (each end stage's own table)
// sums nothing between the stages; a stage that leaves the tie out without
// saying the model is untied, or passes one when it says so, is an
// InvalidArgument on every rank, middle stages included.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>

#include "cohort/mesh/gradient_synchronizer.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"

namespace cohort::testing::mesh_synchronizer_test {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct Layout {
  int pp, dp;
};

class EmbeddingGroup : public ::testing::TestWithParam<Layout> {};

TEST_P(EmbeddingGroup, JoinsTheFirstAndTheLastStage) {
  const auto [pp, dp] = GetParam();
  std::vector<std::shared_ptr<GradientSynchronizer>> keep(static_cast<size_t>(pp * dp));
  run_ranks_shared(pp * dp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    const int r = world->rank();
    auto mesh = init_device_mesh(world, {pp, dp, 1}, {"pp", "dp", "tp"});
    auto stage = std::make_shared<torch::nn::LinearImpl>(3, 2);
    auto sync = std::make_shared<GradientSynchronizer>(mesh, stage, std::vector<torch::Tensor>{},
                                                       stage->weight);
    keep[static_cast<size_t>(r)] = sync;
    const int p = r / dp, d = r % dp;  // rank = p * dp + d
    if (p != 0 && p != pp - 1) {
      EXPECT_EQ(sync->embedding_group(), nullptr) << "rank " << r;
      return;
    }
    ASSERT_NE(sync->embedding_group(), nullptr) << "rank " << r;
    const std::vector<int> ranks =
        pp == 1 ? std::vector<int>{r} : std::vector<int>{d, (pp - 1) * dp + d};
    auto& group = *sync->embedding_group();
    EXPECT_EQ(group.size(), static_cast<int>(ranks.size()));
    EXPECT_EQ(group.rank(), p == 0 ? 0 : 1);
    auto t = torch::tensor({int64_t{1000} + r * r});
    group.all_reduce(t).wait();
    int64_t want = 0;
    for (int q : ranks) want += int64_t{1000} + q * q;
    EXPECT_EQ(t.item<int64_t>(), want) << "rank " << r;
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, EmbeddingGroup,
                         ::testing::Values(Layout{1, 1}, Layout{3, 1}, Layout{3, 2}, Layout{2, 2}),
                         [](const auto& info) {
                           return "pp" + std::to_string(info.param.pp) + "_dp" +
                                  std::to_string(info.param.dp);
                         });

// A parameter of `n` zeros that requires grad (or not).
torch::Tensor parameter(int64_t n, bool requires_grad = true) {
  return torch::zeros({n}, torch::TensorOptions().requires_grad(requires_grad));
}

// A stage of the given parameters.
std::shared_ptr<torch::nn::Module> stage_of(const std::vector<torch::Tensor>& params) {
  auto stage = std::make_shared<torch::nn::Module>("Stage");
  for (size_t i = 0; i < params.size(); ++i) {
    stage->register_parameter("p" + std::to_string(i), params[i], params[i].requires_grad());
  }
  return stage;
}

// Whether `p`'s gradient is defined and everywhere `value`.
::testing::AssertionResult grad_is(const torch::Tensor& p, double value) {
  if (!p.grad().defined()) return ::testing::AssertionFailure() << "no gradient";
  if (!torch::allclose(p.grad(), torch::full_like(p, value))) {
    return ::testing::AssertionFailure() << p.grad() << " instead of " << value;
  }
  return ::testing::AssertionSuccess();
}

class SynchronizeGradients : public ::testing::TestWithParam<EngineWorld> {};

// Over dp: a gradient on rank 0 only (ones) becomes 1 / dp everywhere, one
// on every rank (rank + 1) (dp + 1) / 2, one on no rank and a frozen
// parameter's stay undefined; expert parameters (summed over the replicas,
// divided by the dense group) alike. The DP reducer's buckets hold every
// parameter, the experts go through their own all-reduce.
TEST_P(SynchronizeGradients, OneNoRankHasStaysUndefinedOneSomeHaveIsAveraged) {
  const EngineWorld c = GetParam();
  const int dp = c.world;
  run_ranks_shared(
      dp,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int r = world->rank();
        auto mesh = init_device_mesh(world, {1, dp, 1}, {"pp", "dp", "tp"});
        auto some = parameter(3), none = parameter(2), all = parameter(5),
             frozen = parameter(4, false), expert_some = parameter(3), expert_none = parameter(2);
        GradientSynchronizerOptions options;
        options.expert_parameters = {expert_some, expert_none};
        GradientSynchronizer sync(mesh,
                                  stage_of({some, none, all, frozen, expert_some, expert_none}), {},
                                  torch::Tensor(), options);
        for (int step = 0; step < 2; ++step) {
          SCOPED_TRACE("step " + std::to_string(step) + ", rank " + std::to_string(r));
          for (auto* p : {&some, &none, &all, &frozen, &expert_some, &expert_none}) {
            p->mutable_grad() = torch::Tensor();  // zero_grad(set_to_none), LibTorch 2.x's default
          }
          if (r == 0) some.mutable_grad() = torch::ones({3});
          if (r == 0) expert_some.mutable_grad() = torch::ones({3});
          all.mutable_grad() = torch::full({5}, r + 1.0);
          sync.synchronize();
          EXPECT_TRUE(grad_is(some, 1.0 / dp));
          EXPECT_FALSE(none.grad().defined());
          EXPECT_TRUE(grad_is(all, (dp + 1) / 2.0));
          EXPECT_FALSE(frozen.grad().defined());
          EXPECT_TRUE(grad_is(expert_some, 1.0 / dp));
          EXPECT_FALSE(expert_none.grad().defined());
        }
      },
      options_for(c));
}

INSTANTIATE_TEST_SUITE_P(EngineWorlds, SynchronizeGradients,
                         ::testing::ValuesIn(engine_worlds({1, 2, 3})), engine_world_name);

// Over tp (sequence-parallel parameters, summed) and the tied embedding's
// group (pp 2): a gradient on one rank of the group only (ones) becomes ones
// on both, one on no rank stays undefined, a frozen one keeps none.
TEST(SynchronizeGradientsMesh, SequenceParallelAndTiedEmbeddingLeaveOnesNoRankHasUndefined) {
  run_ranks_shared(4, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    const int r = world->rank();
    auto mesh = init_device_mesh(world, {2, 1, 2}, {"pp", "dp", "tp"});
    const bool first = mesh.local_rank("pp") == 0, tp0 = mesh.local_rank("tp") == 0;
    auto sp_some = parameter(3), sp_none = parameter(2), sp_frozen = parameter(2, false),
         embedding = parameter(4);
    GradientSynchronizer sync(mesh, stage_of({sp_some, sp_none, sp_frozen, embedding}),
                              {sp_some, sp_none, sp_frozen}, embedding);
    SCOPED_TRACE("rank " + std::to_string(r));
    if (tp0) sp_some.mutable_grad() = torch::ones({3});
    if (first) embedding.mutable_grad() = torch::ones({4});
    sync.synchronize();
    EXPECT_TRUE(grad_is(sp_some, 1.0));
    EXPECT_FALSE(sp_none.grad().defined());
    EXPECT_FALSE(sp_frozen.grad().defined());
    EXPECT_TRUE(grad_is(embedding, 1.0));
    // No stage has the embedding's gradient now: it stays undefined.
    for (auto* p : {&sp_some, &sp_none, &sp_frozen, &embedding})
      p->mutable_grad() = torch::Tensor();
    sync.synchronize();
    EXPECT_FALSE(embedding.grad().defined());
    EXPECT_FALSE(sp_some.grad().defined());
  });
}

// Untied (pp 3 x tp 2): the first stage's word table and the last stage's
// output table keep their own gradients (1 and 2, not their sum 3), nothing
// is sent between the stages, and a sequence-parallel sum over tp still runs.
TEST(SynchronizeGradientsMesh, UntiedEmbeddingsKeepTheirOwnGradients) {
  run_ranks_shared(6, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {3, 1, 2}, {"pp", "dp", "tp"});
    const int stage = mesh.local_rank("pp");
    const bool tp0 = mesh.local_rank("tp") == 0;
    auto table = parameter(4), sp = parameter(3);
    GradientSynchronizerOptions options;
    options.untied_embedding = true;
    GradientSynchronizer sync(mesh, stage_of({table, sp}), {sp}, torch::Tensor(), options);
    SCOPED_TRACE("rank " + std::to_string(world->rank()));
    table.mutable_grad() = torch::full({4}, stage + 1.0);
    if (tp0) sp.mutable_grad() = torch::ones({3});
    sync.synchronize();
    EXPECT_TRUE(grad_is(table, stage + 1.0));
    EXPECT_TRUE(grad_is(sp, 1.0));
    EXPECT_EQ(sync.stats().pp.ops, 0);
    EXPECT_FALSE(sync.shared_embedding().defined());
  });
}

// The tie on a pp 3 (x tp 2) mesh: `passes(stage)` says whether a stage
// passes its table as the shared embedding, `untied(rank)` sets
// untied_embedding. Every rank's error (none must be a timeout).
std::vector<std::string> tie_errors(int tp, const std::function<bool(int)>& passes,
                                    const std::function<bool(int)>& untied) {
  return errors_on_every_rank(3 * tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {3, 1, tp}, {"pp", "dp", "tp"});
    auto table = parameter(4);
    GradientSynchronizerOptions options;
    options.untied_embedding = untied(world->rank());
    GradientSynchronizer sync(mesh, stage_of({table}), {},
                              passes(mesh.local_rank("pp")) ? table : torch::Tensor(), options);
  });
}

TEST(GradientSynchronizerMesh, AMissingOrContradictedTieIsRefusedOnEveryRank) {
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    auto expect_all = [&](const std::vector<std::string>& errors, const std::string& message) {
      for (size_t r = 0; r < errors.size(); ++r) {
        EXPECT_TRUE(has(errors[r], "GradientSynchronizer (rank " + std::to_string(r) + "): ") &&
                    has(errors[r], message))
            << "rank " << r << ": " << errors[r];
      }
    };
    auto never = [](int) { return false; };
    // Tied (the default) but no stage passes the tie: the first end stage named.
    expect_all(tie_errors(tp, never, never),
               "mesh rank 0 (pipeline stage 0) passed no shared_embedding: at pp 3 the first "
               "and the last stage of a model whose output layer is the word embedding (tied) "
               "must each pass their copy");
    expect_all(tie_errors(tp, never, never), "set GradientSynchronizerOptions::untied_embedding");
    // The first stage passes it, the last one forgets.
    expect_all(tie_errors(
                   tp, [](int s) { return s == 0; }, never),
               "mesh rank " + std::to_string(2 * tp) +
                   " (pipeline stage 2) passed no "
                   "shared_embedding");
    // Untied, yet the last stage passes one.
    expect_all(tie_errors(
                   tp, [](int s) { return s == 2; }, [](int) { return true; }),
               "mesh rank " + std::to_string(2 * tp) +
                   " (pipeline stage 2) passed a shared_embedding, but "
                   "options.untied_embedding says the output layer has weights of its own");
    // Ranks that disagree on the option.
    const auto errors = tie_errors(tp, never, [](int r) { return r == 1; });
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_TRUE(has(errors[r], r == 1 ? "options.untied_embedding is true here but false on "
                                          "mesh rank 0 (pipeline stage 0)"
                                        : "options.untied_embedding is false here but true on "
                                          "mesh rank 1 (pipeline stage " +
                                              std::to_string(1 / tp) + ")"))
          << "rank " << r << ": " << errors[r];
    }
  }
}

// A synchronizer over a mesh of `sizes` and `names` (world 2) fails on every
// rank with `message`.
void expect_refused(const std::vector<int>& sizes, const std::vector<std::string>& names,
                    const std::string& message) {
  auto errors = errors_on_every_rank(2, [&](std::shared_ptr<Communicator> world) {
    auto stage = std::make_shared<torch::nn::LinearImpl>(3, 2);
    GradientSynchronizer sync(init_device_mesh(world, sizes, names), stage, {}, stage->weight);
  });
  for (int r = 0; r < 2; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "GradientSynchronizer (rank " + std::to_string(r) + "): ")) << e;
    EXPECT_TRUE(has(e, message)) << e;
  }
}

TEST(GradientSynchronizerMesh, DimensionsItCannotReduceOverAreNamed) {
  expect_refused({2, 1}, {"dp", "tp"}, "the mesh (dp=2 tp=1) has no dimension 'pp'");
  expect_refused({1, 1, 2, 1}, {"pp", "dp", "sp", "tp"},
                 "dimension 'sp' of the mesh (pp=1 dp=1 sp=2 tp=1) would be left unreduced");
  // Experts split over ep, but not named: averaging them over ep would mix
  // different experts' gradients.
  expect_refused({1, 1, 2, 1}, {"pp", "dp", "ep", "tp"},
                 "the mesh (pp=1 dp=1 ep=2 tp=1) splits experts over ep, but "
                 "options.expert_parameters is empty");
}

}  // namespace
}  // namespace cohort::testing::mesh_synchronizer_test
