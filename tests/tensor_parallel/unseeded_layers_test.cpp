// The tensor-parallel layers built without a seed draw one from LibTorch's
// default CPU generator, as torch::nn::Linear draws its weights: two layers
// of one shape differ, torch::manual_seed draws the same model again, and
// the shards of every TP rank are slices of one full weight. Built with a
// seed they hold that seed's weights exactly and draw nothing. At tp = 1, 2,
// 3 with ranks as threads (which share the default generator).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "support/thread_ranks.h"

namespace cohort::testing::unseeded_layers_test {
namespace {

using namespace cohort::tensor_parallel;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// 6 divides by every tp here.
constexpr int64_t kIn = 4, kOut = 6, kVocab = 6, kDim = 3;

// This rank's part of a tensor split along `dim` over `g`, gathered: the
// whole tensor, on every rank.
torch::Tensor gather_full(const torch::Tensor& part, int64_t dim, Communicator& g) {
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < g.size(); ++r) parts.push_back(torch::empty_like(part));
  g.all_gather(parts, part.contiguous()).wait();
  return torch::cat(parts, dim);
}

// Two layers of each kind and shape, built without a seed, as full tensors.
Named two_of_each(const std::shared_ptr<Communicator>& g) {
  const auto tp = DeviceMesh::from_group(g, "tp");
  ColumnParallelLinear c1(tp, kIn, kOut), c2(tp, kIn, kOut);
  RowParallelLinear r1(tp, kOut, kIn), r2(tp, kOut, kIn);
  VocabParallelEmbedding e1(tp, kVocab, kDim), e2(tp, kVocab, kDim);
  return {{"column weight 1", gather_full(c1->weight, 0, *g)},
          {"column weight 2", gather_full(c2->weight, 0, *g)},
          {"column bias 1", gather_full(c1->bias, 0, *g)},
          {"column bias 2", gather_full(c2->bias, 0, *g)},
          {"row weight 1", gather_full(r1->weight, 1, *g)},
          {"row weight 2", gather_full(r2->weight, 1, *g)},
          {"row bias 1", r1->bias},
          {"row bias 2", r2->bias},
          {"embedding 1", gather_full(e1->weight, 0, *g)},
          {"embedding 2", gather_full(e2->weight, 0, *g)}};
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

class UnseededLayers : public ::testing::TestWithParam<int> {};

// The second layer of a shape is not a copy of the first (every attention
// projection of a model the same one).
TEST_P(UnseededLayers, TwoLayersOfOneShapeDiffer) {
  run_ranks_shared(GetParam(), [](std::shared_ptr<Communicator> g) {
    const auto w = two_of_each(g);
    for (size_t i = 0; i < w.size(); i += 2) {
      const double d = max_abs_diff(w[i].second, w[i + 1].second);
      EXPECT_GT(d, 0.0) << w[i].first << " and " << w[i + 1].first << " on rank " << g->rank()
                        << ": max |difference| " << d;
    }
  });
}

// torch::manual_seed(s) before the model draws the same model again, and
// another s another model.
TEST_P(UnseededLayers, ManualSeedDrawsTheSameModelAgain) {
  const int tp = GetParam();
  auto draw = [&](uint64_t s) {
    torch::manual_seed(s);
    return results_of_ranks<Named>(tp, two_of_each).begin()->second;
  };
  const auto a = draw(11), again = draw(11), other = draw(12);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].second, again[i].second))
        << a[i].first << ": max |difference| " << max_abs_diff(a[i].second, again[i].second);
    const double d = max_abs_diff(a[i].second, other[i].second);
    EXPECT_GT(d, 0.0) << a[i].first << " under manual_seed 11 and 12: max |difference| " << d;
  }
}

// The seed every TP rank uses is one, and each rank's shard is its slice of
// the full weights of that seed: the shards, gathered, are one full weight.
TEST_P(UnseededLayers, ShardsAreSlicesOfOneFullWeight) {
  run_ranks_shared(GetParam(), [](std::shared_ptr<Communicator> g) {
    const auto tp = DeviceMesh::from_group(g, "tp");
    ColumnParallelLinear column(tp, kIn, kOut);
    RowParallelLinear row(tp, kOut, kIn);
    VocabParallelEmbedding embedding(tp, kVocab, kDim);
    for (const uint64_t s : {column->seed(), row->seed(), embedding->seed()}) {
      const auto seeds = gather_full(torch::tensor({static_cast<int64_t>(s)}), 0, *g);
      EXPECT_TRUE(seeds.eq(seeds[0]).all().item<bool>()) << "seeds " << seeds;
    }
    auto [cw, cb] = master_linear_weights(kIn, kOut, column->seed());
    EXPECT_TRUE(torch::equal(gather_full(column->weight, 0, *g), cw)) << "column weight";
    EXPECT_TRUE(torch::equal(gather_full(column->bias, 0, *g), cb)) << "column bias";
    auto [rw, rb] = master_linear_weights(kOut, kIn, row->seed());
    EXPECT_TRUE(torch::equal(gather_full(row->weight, 1, *g), rw)) << "row weight";
    EXPECT_TRUE(torch::equal(row->bias, rb)) << "row bias";
    VocabParallelEmbeddingOptions o;
    o.seed = embedding->seed();
    EXPECT_TRUE(torch::equal(gather_full(embedding->weight, 0, *g),
                             master_embedding_weight(kVocab, kDim, o)))
        << "embedding";
  });
}

// An explicit seed: that seed's weights exactly, as before seeds were
// optional, and the default generator untouched.
TEST_P(UnseededLayers, AnExplicitSeedDrawsItsWeightsAndNothingElse) {
  const int tp = GetParam();
  torch::manual_seed(3);
  const auto before = at::detail::getDefaultCPUGenerator().get_state();
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    const auto mesh = DeviceMesh::from_group(g, "tp");
    const int r = g->rank();
    ColumnParallelLinearOptions c;
    c.seed = 5;
    ColumnParallelLinear column(mesh, kIn, kOut, c);
    RowParallelLinearOptions ro;
    ro.seed = 7;
    RowParallelLinear row(mesh, kOut, kIn, ro);
    VocabParallelEmbeddingOptions e;
    e.seed = 9;
    VocabParallelEmbedding embedding(mesh, kVocab, kDim, e);
    EXPECT_EQ(column->seed(), 5u);
    EXPECT_EQ(row->seed(), 7u);
    EXPECT_EQ(embedding->seed(), 9u);
    auto [cw, cb] = master_linear_weights(kIn, kOut, 5);
    EXPECT_TRUE(torch::equal(column->weight, split_along(cw, 0, r, tp, "cw")));
    EXPECT_TRUE(torch::equal(column->bias, split_along(cb, 0, r, tp, "cb")));
    auto [rw, rb] = master_linear_weights(kOut, kIn, 7);
    EXPECT_TRUE(torch::equal(row->weight, split_along(rw, 1, r, tp, "rw")));
    EXPECT_TRUE(torch::equal(row->bias, rb));
    EXPECT_TRUE(torch::equal(embedding->weight,
                             split_along(master_embedding_weight(kVocab, kDim, e), 0, r, tp, "e")));
  });
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
}

// clone() copies the values and the seed, and neither draws nor
// communicates: one rank clones alone.
TEST_P(UnseededLayers, CloneCopiesWithoutDrawingOrCommunicating) {
  run_ranks_shared(GetParam(), [](std::shared_ptr<Communicator> g) {
    const auto tp = DeviceMesh::from_group(g, "tp");
    torch::nn::Sequential model(ColumnParallelLinear(tp, kIn, kOut),
                                RowParallelLinear(tp, kOut, kIn),
                                VocabParallelEmbedding(tp, kVocab, kDim));
    {  // trained a little: a fresh draw from the seed would not match
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.add_(0.25);
    }
    if (g->rank() != 0) return;
    const auto before = at::detail::getDefaultCPUGenerator().get_state();
    auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
    EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
    const auto a = model->named_parameters(), b = copy->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& p : a) EXPECT_TRUE(torch::equal(p.value(), b[p.key()])) << p.key();
    EXPECT_EQ(copy->ptr<ColumnParallelLinearImpl>(0)->seed(),
              model->ptr<ColumnParallelLinearImpl>(0)->seed());
    EXPECT_EQ(copy->ptr<VocabParallelEmbeddingImpl>(2)->seed(),
              model->ptr<VocabParallelEmbeddingImpl>(2)->seed());
  });
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, UnseededLayers, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// One layer is one draw of 64 bits from the default generator.
TEST(UnseededLayer, DrawsOneValueFromTheDefaultGenerator) {
  torch::manual_seed(21);
  auto want = at::detail::createCPUGenerator(21);
  const uint64_t first = at::check_generator<at::CPUGeneratorImpl>(want)->random64();
  const uint64_t second = at::check_generator<at::CPUGeneratorImpl>(want)->random64();
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> g) {
    const auto tp = DeviceMesh::from_group(g, "tp");
    EXPECT_EQ(ColumnParallelLinear(tp, kIn, kOut)->seed(), first);
    EXPECT_EQ(VocabParallelEmbedding(tp, kVocab, kDim)->seed(), second);
  });
}

// The reference of a layer without a seed needs the layer's seed().
TEST(UnseededLayer, MasterEmbeddingWeightWantsASeed) {
  try {
    master_embedding_weight(kVocab, kDim, {});
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("master_embedding_weight: options.seed is unset"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cohort::testing::unseeded_layers_test
