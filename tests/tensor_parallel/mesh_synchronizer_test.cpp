// GradientSynchronizer on a DeviceMesh: the embedding group it splits from
// the "pp" group joins exactly the first and the last stage (closed form,
// and an all-reduce over it sums exactly their values), and a mesh it cannot
// reduce over is an InvalidArgument on every rank naming the dimension.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "cohort/mesh/gradient_synchronizer.h"
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
