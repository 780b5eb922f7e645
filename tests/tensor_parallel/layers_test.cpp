// Each tensor-parallel layer at tp = 1..4 against its dense LibTorch
// equivalent built from the same seed (master_*_weights), forward and
// backward; the vocab-parallel cross-entropy against
// torch::nn::functional::cross_entropy; f and g against closed forms; the
// sequence gather before a replicated consumer against one process;
// split_dims against the layers it must name.
// With COHORT_TEST_DEVICE=cuda the layer-against-dense cases put the
// layers, the data and the dense reference on the GPU.
#include "cohort/tensor_parallel/layers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include "cohort/core/rank_local.h"
#include "cohort/tensor_parallel/mappings.h"
#include "support/tensor_checks.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"

namespace cohort::testing::layers_test {
namespace {

using namespace cohort::tensor_parallel;

// Drawn on the CPU (the same values on every device), kept on test_device().
torch::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  return torch::randn(sizes, at::detail::createCPUGenerator(seed)).to(test_device());
}

std::pair<torch::Tensor, torch::Tensor> linear_weights(int64_t in, int64_t out, uint64_t seed) {
  auto [w, b] = master_linear_weights(in, out, seed);
  return {w.to(test_device()), b.to(test_device())};
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  cohort::testing::expect_allclose(got, want, what);
}

class Layers : public ::testing::TestWithParam<int> {};

TEST_P(Layers, ColumnParallelLinearMatchesDense) {
  const int tp = GetParam();
  const int64_t in = 6, out = 12;
  auto [w, b] = linear_weights(in, out, 5);
  const auto x0 = randn({2, 3, in}, 1), c = randn({2, 3, out}, 2);
  auto wd = w.clone().requires_grad_(), bd = b.clone().requires_grad_();
  auto xd = x0.clone().requires_grad_();
  auto yd = torch::linear(xd, wd, bd);
  (yd * c).sum().backward();

  for (bool gather : {false, true}) {
    run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
      torch::set_num_threads(1);
      ColumnParallelLinearOptions o;
      o.seed = 5;
      o.gather_output = gather;
      ColumnParallelLinear layer(cohort::DeviceMesh::from_group(g, "tp"), in, out, o);
      layer->to(test_device());
      const auto r = g->rank();
      expect_close(layer->weight, split_along(w, 0, r, tp, "w"), "weight shard");
      auto x = x0.clone().requires_grad_();
      auto y = layer(x);
      auto cy = gather ? c : split_along(c, -1, r, tp, "c");
      expect_close(y, gather ? yd : split_along(yd, -1, r, tp, "y"), "output");
      (y * cy).sum().backward();
      // f's backward all-reduced the input gradient; with gather_output the
      // output gradient was split back.
      expect_close(x.grad(), xd.grad(), "input grad");
      expect_close(layer->weight.grad(), split_along(wd.grad(), 0, r, tp, "gw"), "weight grad");
      expect_close(layer->bias.grad(), split_along(bd.grad(), 0, r, tp, "gb"), "bias grad");
    });
  }
}

TEST_P(Layers, RowParallelLinearMatchesDense) {
  const int tp = GetParam();
  const int64_t in = 12, out = 5;
  auto [w, b] = linear_weights(in, out, 7);
  const auto x0 = randn({4, in}, 3), c = randn({4, out}, 4);
  auto wd = w.clone().requires_grad_(), bd = b.clone().requires_grad_();
  auto xd = x0.clone().requires_grad_();
  auto yd = torch::linear(xd, wd, bd);
  (yd * c).sum().backward();

  for (bool parallel_input : {true, false}) {
    run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
      torch::set_num_threads(1);
      RowParallelLinearOptions o;
      o.seed = 7;
      o.input_is_parallel = parallel_input;
      RowParallelLinear layer(cohort::DeviceMesh::from_group(g, "tp"), in, out, o);
      layer->to(test_device());
      const auto r = g->rank();
      auto x = (parallel_input ? split_along(x0, 1, r, tp, "x") : x0).clone().requires_grad_();
      auto y = layer(x);
      expect_close(y, yd, "output");
      (y * c).sum().backward();
      expect_close(x.grad(), parallel_input ? split_along(xd.grad(), 1, r, tp, "gx") : xd.grad(),
                   "input grad");
      expect_close(layer->weight.grad(), split_along(wd.grad(), 1, r, tp, "gw"), "weight grad");
      expect_close(layer->bias.grad(), bd.grad(), "bias grad");
    });
  }
}

TEST_P(Layers, VocabParallelEmbeddingMatchesDense) {
  const int tp = GetParam();
  const int64_t vocab = 12, dim = 5;
  VocabParallelEmbeddingOptions o;
  o.seed = 9;
  auto wd = master_embedding_weight(vocab, dim, o).to(test_device()).requires_grad_();
  const auto ids =
      torch::randint(vocab, {3, 4}, at::detail::createCPUGenerator(8)).to(test_device());
  const auto c = randn({3, 4, dim}, 10);
  auto yd = torch::embedding(wd, ids);
  (yd * c).sum().backward();

  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    VocabParallelEmbedding layer(cohort::DeviceMesh::from_group(g, "tp"), vocab, dim, o);
    layer->to(test_device());
    auto y = layer(ids);
    expect_close(y, yd, "output");
    (y * c).sum().backward();
    expect_close(layer->weight.grad(), split_along(wd.grad(), 0, g->rank(), tp, "gw"),
                 "weight grad");
  });
}

TEST_P(Layers, VocabParallelCrossEntropyMatchesTorch) {
  const int tp = GetParam();
  const int64_t vocab = 12;
  // Large logits: the max subtraction must keep exp() finite.
  for (double offset : {0.0, 80.0}) {
    const auto z0 = randn({3, 5, vocab}, 11) * 3 + offset;
    const auto target =
        torch::randint(vocab, {3, 5}, at::detail::createCPUGenerator(12)).to(test_device());
    const auto c = randn({3, 5}, 13);
    auto zd = z0.clone().requires_grad_();
    namespace F = torch::nn::functional;
    auto ld = F::cross_entropy(zd.reshape({-1, vocab}), target.reshape({-1}),
                               F::CrossEntropyFuncOptions().reduction(torch::kNone))
                  .reshape({3, 5});
    (ld * c).sum().backward();

    run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
      torch::set_num_threads(1);
      auto z = split_along(z0, 2, g->rank(), tp, "z").clone().requires_grad_();
      auto loss = vocab_parallel_cross_entropy(z, target, *g);
      expect_close(loss, ld, "loss");
      (loss * c).sum().backward();
      expect_close(z.grad(), split_along(zd.grad(), 2, g->rank(), tp, "gz"), "logit grad");
    });
  }
}

// Rank r holds (r + 1) everywhere: sums over ranks are n(n + 1)/2.
TEST_P(Layers, ConjugateMappingsClosedForm) {
  const int n = GetParam();
  const double total = n * (n + 1) / 2.0;
  run_ranks_shared(n, [&](std::shared_ptr<Communicator> g) {
    const double mine = g->rank() + 1;
    auto x = torch::full({2, 3}, mine).requires_grad_();
    auto y = copy_to_tensor_parallel_region(x, *g);  // f
    EXPECT_TRUE(torch::equal(y, x));
    y.backward(torch::full({2, 3}, mine));
    EXPECT_TRUE(torch::equal(x.grad(), torch::full({2, 3}, total)));

    auto x2 = torch::full({2, 3}, mine).requires_grad_();
    auto z = reduce_from_tensor_parallel_region(x2, *g);  // g
    EXPECT_TRUE(torch::equal(z, torch::full({2, 3}, total)));
    z.backward(torch::full({2, 3}, mine));
    EXPECT_TRUE(torch::equal(x2.grad(), torch::full({2, 3}, mine)));

    // Sequence-parallel pair: all-gather forward, reduce-scatter backward.
    auto x3 = torch::full({2, 3}, mine).requires_grad_();
    auto gathered = gather_from_sequence_parallel_region(x3, *g);
    ASSERT_EQ(gathered.size(0), 2 * n);
    for (int r = 0; r < n; ++r) EXPECT_EQ(gathered[2 * r][0].item<double>(), r + 1);
    gathered.backward(torch::full({2 * n, 3}, mine));
    EXPECT_TRUE(torch::equal(x3.grad(), torch::full({2, 3}, total)));

    // reduce-scatter forward, all-gather backward.
    auto x4 = torch::full({2 * n, 3}, mine).requires_grad_();
    auto scattered = reduce_scatter_to_sequence_parallel_region(x4, *g);
    EXPECT_TRUE(torch::equal(scattered, torch::full({2, 3}, total)));
    scattered.backward(torch::full({2, 3}, mine));
    for (int r = 0; r < n; ++r) EXPECT_EQ(x4.grad()[2 * r][0].item<double>(), r + 1);
  });
}

// gather_from_sequence_parallel_region without tensor_parallel_output_grad,
// before a consumer computed alike on every rank (a pooler over the whole
// sequence): each rank's slice gets its slice of one process's gradient, at
// first order and through a gradient penalty (second order).
TEST_P(Layers, SequenceGatherForAReplicatedConsumerMatchesDense) {
  const int tp = GetParam();
  const auto x0 = randn({2 * tp, 3}, 14), w = randn({3}, 15);
  auto pooled_loss = [&](const torch::Tensor& full) { return torch::tanh(full.mean(0) * w).sum(); };
  auto xd = x0.clone().requires_grad_();
  auto gd = torch::autograd::grad({pooled_loss(xd)}, {xd}, {}, true, true)[0];
  const auto first = gd.detach().clone();
  gd.pow(2).sum().backward();

  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    const int r = g->rank();
    auto x = split_along(x0, 0, r, tp, "x").clone().requires_grad_();
    auto full = gather_from_sequence_parallel_region(x, *g, /*tensor_parallel_output_grad=*/false);
    expect_close(full, x0, "gathered");
    auto gx = torch::autograd::grad({pooled_loss(full)}, {x}, {}, true, true)[0];
    expect_close(gx, split_along(first, 0, r, tp, "g"), "input grad");
    gx.pow(2).sum().backward();
    expect_close(x.grad(), split_along(xd.grad(), 0, r, tp, "gg"), "gradient penalty's grad");
  });
}

// split_dims names exactly the parameters the layers shard, with the dimension
// whose size is the full size divided by tp, in nested modules too.
TEST_P(Layers, SplitDimsNamesTheShardedParameters) {
  const int tp = GetParam();
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::nn::Module root;
    auto block = std::make_shared<torch::nn::Module>();
    auto col = root.register_module(
        "col", ColumnParallelLinear(cohort::DeviceMesh::from_group(g, "tp"), 4, 12));
    ColumnParallelLinearOptions no_bias;
    no_bias.bias = false;
    auto col2 = block->register_module(
        "col2", ColumnParallelLinear(cohort::DeviceMesh::from_group(g, "tp"), 4, 12, no_bias));
    auto row = block->register_module(
        "row", RowParallelLinear(cohort::DeviceMesh::from_group(g, "tp"), 12, 4));
    auto emb = block->register_module(
        "emb", VocabParallelEmbedding(cohort::DeviceMesh::from_group(g, "tp"), 12, 4));
    auto dense = block->register_module("dense", torch::nn::Linear(4, 4));
    root.register_module("block", block);
    const auto dims = split_dims(root);
    auto dim_of = [&](const torch::Tensor& t) {
      const auto it = dims.find(t.unsafeGetTensorImpl());
      return it == dims.end() ? int64_t{-1} : it->second;
    };
    // Over a group of one rank every layer holds its whole tensors.
    auto split = [&](int64_t dim) { return tp > 1 ? dim : int64_t{-1}; };
    EXPECT_EQ(dims.size(), tp > 1 ? 5u : 0u);
    EXPECT_EQ(dim_of(col->weight), split(0));
    EXPECT_EQ(dim_of(col->bias), split(0));
    EXPECT_EQ(dim_of(col2->weight), split(0));
    EXPECT_EQ(dim_of(row->weight), split(1));
    EXPECT_EQ(dim_of(row->bias), -1);  // replicated
    EXPECT_EQ(dim_of(emb->weight), split(0));
    EXPECT_EQ(dim_of(dense->weight), -1);
    EXPECT_EQ(dim_of(dense->bias), -1);
    EXPECT_EQ(col->weight.size(0) * tp, 12);
    EXPECT_EQ(row->weight.size(1) * tp, 12);
    EXPECT_EQ(emb->weight.size(0) * tp, 12);
  });
}

// A model of one's own that holds the TP layers, Cloneable as LibTorch
// wants: reset() registers them.
struct HolderImpl : torch::nn::Cloneable<HolderImpl> {
  explicit HolderImpl(cohort::DeviceMesh tp) : tp(std::move(tp)) { reset(); }
  void reset() override {
    ColumnParallelLinearOptions c;
    c.seed = 5;
    col = register_module("col", ColumnParallelLinear(tp, 4, 12, c));
    row = register_module("row", RowParallelLinear(tp, 12, 4));
    emb = register_module("emb", VocabParallelEmbedding(tp, 12, 4));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return row(col(emb(ids))); }
  cohort::DeviceMesh tp;
  ColumnParallelLinear col{nullptr};
  RowParallelLinear row{nullptr};
  VocabParallelEmbedding emb{nullptr};
};
TORCH_MODULE(Holder);

// clone() (of the layers inside a model, through Cloneable's clone_) is a
// deep copy whose split parameters carry the original's TP marks, and
// computes the same.
TEST_P(Layers, CloneKeepsTheValuesAndTheTensorParallelMarks) {
  const int tp = GetParam();
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    Holder original(cohort::DeviceMesh::from_group(g, "tp"));
    {  // trained a little, so that the clone copies values, not a fresh draw
      torch::NoGradGuard no_grad;
      for (auto& p : original->parameters()) p.add_(0.25);
    }
    Holder copy(std::dynamic_pointer_cast<HolderImpl>(original->clone()));
    const auto a = original->named_parameters(), b = copy->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& p : a) {
      const auto& q = b[p.key()];
      EXPECT_TRUE(torch::equal(p.value(), q)) << p.key();
      EXPECT_NE(p.value().data_ptr(), q.data_ptr()) << p.key();
      const auto want = tensor_parallel_part(p.value()), got = tensor_parallel_part(q);
      EXPECT_EQ(got.rank, want.rank) << p.key();
      EXPECT_EQ(got.size, want.size) << p.key();
      EXPECT_EQ(got.group, want.group) << p.key();
    }
    // The split ones are marked (at tp > 1), the row bias is whole.
    EXPECT_EQ(tensor_parallel_part(copy->col->weight).size, tp);
    EXPECT_EQ(tensor_parallel_part(copy->col->bias).rank, tp > 1 ? g->rank() : 0);
    EXPECT_EQ(tensor_parallel_part(copy->row->weight).size, tp);
    EXPECT_EQ(tensor_parallel_part(copy->emb->weight).size, tp);
    EXPECT_EQ(tensor_parallel_part(copy->row->bias).size, 1);
    EXPECT_EQ(copy->col->options().seed, 5u);
    EXPECT_EQ(copy->emb->vocab_start_index(), original->emb->vocab_start_index());
    EXPECT_EQ(split_dims(*copy).size(), split_dims(*original).size());
    auto ids = torch::arange(12).reshape({3, 4});
    EXPECT_TRUE(torch::allclose(copy(ids), original(ids)));
  });
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, Layers, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

TEST(LayerErrors, SizesThatDoNotDivideNameTheLayer) {
  run_ranks_shared(4, [](std::shared_ptr<Communicator> g) {
    auto message = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const InvalidArgument& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    auto m = message([&] { ColumnParallelLinear(cohort::DeviceMesh::from_group(g, "tp"), 4, 10); });
    EXPECT_NE(m.find("ColumnParallelLinear"), std::string::npos) << m;
    EXPECT_NE(m.find("out_features = 10 does not divide by the tensor-parallel size 4"),
              std::string::npos)
        << m;
    m = message([&] { RowParallelLinear(cohort::DeviceMesh::from_group(g, "tp"), 6, 4); });
    EXPECT_NE(m.find("RowParallelLinear"), std::string::npos) << m;
    EXPECT_NE(m.find("in_features = 6"), std::string::npos) << m;
    m = message([&] { VocabParallelEmbedding(cohort::DeviceMesh::from_group(g, "tp"), 65, 8); });
    EXPECT_NE(m.find("VocabParallelEmbedding"), std::string::npos) << m;
    EXPECT_NE(m.find("num_embeddings = 65"), std::string::npos) << m;
  });
}

// A layer splits over one dimension: the whole 2-D mesh is refused on every
// rank, naming the layer and the mesh, while its 1-D slice builds.
TEST(LayerErrors, MeshesThatAreNotOneDimensionalAreRefused) {
  run_ranks_shared(4, [](std::shared_ptr<Communicator> g) {
    auto mesh = init_device_mesh(g, {2, 2}, {"dp", "tp"});
    auto message = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const InvalidArgument& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    for (const auto& [layer, build] :
         std::vector<std::pair<std::string, std::function<void(const DeviceMesh&)>>>{
             {"ColumnParallelLinear", [](const DeviceMesh& m) { ColumnParallelLinear(m, 4, 4); }},
             {"RowParallelLinear", [](const DeviceMesh& m) { RowParallelLinear(m, 4, 4); }},
             {"VocabParallelEmbedding",
              [](const DeviceMesh& m) { VocabParallelEmbedding(m, 4, 4); }}}) {
      auto m = message([&] { build(mesh); });
      EXPECT_NE(m.find(layer), std::string::npos) << m;
      EXPECT_NE(m.find("must be 1-D"), std::string::npos) << m;
      EXPECT_NE(m.find("dp=2 tp=2"), std::string::npos) << m;
      EXPECT_EQ(message([&] { build(mesh["tp"]); }), "no error") << layer;
    }
  });
}

}  // namespace
}  // namespace cohort::testing::layers_test
