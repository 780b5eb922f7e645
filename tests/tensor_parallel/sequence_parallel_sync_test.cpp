// GradientSynchronizer under sequence parallelism: a block whose LayerNorm
// and RowParallelLinear bias see sequence-split activations gets, after
// finish_backward, the gradients of one process at tp 1 when the caller
// lists only the LayerNorm (the layer names its bias itself, and a bias
// listed again is summed once); a LayerNorm left out is an InvalidArgument
// on every rank at the first step (its TP replicas' gradients differ), and
// a listed tensor that is not the stage's, or is split over TP, is refused at
// construction, as are replicas whose values differ; one that sees whole
// activations is refused at the first step. A parameter frozen while the
// synchronizer is built and unfrozen later is summed like the others.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/normalization.h>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "support/rank_errors.h"
#include "support/tensor_checks.h"
#include "support/thread_ranks.h"

namespace cohort::testing::sequence_parallel_sync_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kSeq = 6, kHidden = 4, kFfn = 6;
constexpr uint64_t kSeedIn = 11, kSeedOut = 12;

torch::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  return torch::randn(sizes, at::detail::createCPUGenerator(seed));
}

// y = x + RowParallel(relu(ColumnParallel(LayerNorm(x)))), x and y split
// along the sequence (dim 0) over TP.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const DeviceMesh& tp) {
    ColumnParallelLinearOptions c;
    c.sequence_parallel = true;
    c.seed = kSeedIn;
    RowParallelLinearOptions r;
    r.sequence_parallel = true;
    r.seed = kSeedOut;
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    in = register_module("in", ColumnParallelLinear(tp, kHidden, kFfn, c));
    out = register_module("out", RowParallelLinear(tp, kFfn, kHidden, r));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + out(torch::relu(in(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  ColumnParallelLinear in{nullptr};
  RowParallelLinear out{nullptr};
};
TORCH_MODULE(Block);

// The gradients of the whole block in one process (tp 1, plain LibTorch):
// LayerNorm weight and bias, then the two linears' weights and biases.
std::vector<torch::Tensor> reference_grads(const torch::Tensor& x, const torch::Tensor& c) {
  auto [w1, b1] = master_linear_weights(kHidden, kFfn, kSeedIn);
  auto [w2, b2] = master_linear_weights(kFfn, kHidden, kSeedOut);
  std::vector<torch::Tensor> p = {torch::ones({kHidden}), torch::zeros({kHidden}), w1, b1, w2, b2};
  for (auto& t : p) t.requires_grad_();
  auto h = torch::layer_norm(x, {kHidden}, p[0], p[1]);
  auto y = x + torch::linear(torch::relu(torch::linear(h, p[2], p[3])), p[4], p[5]);
  (y * c).sum().backward();
  std::vector<torch::Tensor> g;
  for (auto& t : p) g.push_back(t.grad());
  return g;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  cohort::testing::expect_allclose(got, want, what);
}

// Which parameters the caller lists as sequence-parallel.
enum class Listed { LayerNorm, LayerNormAndBiasTwice, Nothing };

// One step of the block on tp ranks (threads) with the caller listing
// `listed`; runs `check(block, rank)` after finish_backward. With
// `unfreeze_later`, the row-parallel bias is frozen while the synchronizer
// is built and unfrozen before the step.
void step(int tp, Listed listed, const std::function<void(Block&, int)>& check,
          bool unfreeze_later = false) {
  const auto x = randn({kSeq, kHidden}, 1), c = randn({kSeq, kHidden}, 2);
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
    Block block(mesh["tp"]);
    std::vector<torch::Tensor> sp;
    if (listed != Listed::Nothing) sp = {block->ln->weight, block->ln->bias};
    if (listed == Listed::LayerNormAndBiasTwice) {
      sp.insert(sp.end(), {block->out->bias, block->out->bias});
    }
    if (unfreeze_later) block->out->bias.requires_grad_(false);
    cohort::GradientSynchronizer sync(mesh, block.ptr(), sp, torch::Tensor());
    if (unfreeze_later) block->out->bias.requires_grad_(true);
    const int r = world->rank();
    sync.prepare_forward();
    auto y = block(split_along(x, 0, r, tp, "x").clone());
    sync.after_forward({y});
    (y * split_along(c, 0, r, tp, "c")).sum().backward();
    sync.finish_backward();
    check(block, r);
  });
}

class SequenceParallelSync : public ::testing::TestWithParam<int> {};

TEST_P(SequenceParallelSync, LayersNameTheirBiasTheCallerItsLayerNorm) {
  const int tp = GetParam();
  const auto x = randn({kSeq, kHidden}, 1), c = randn({kSeq, kHidden}, 2);
  const auto want = reference_grads(x, c);
  for (Listed listed : {Listed::LayerNorm, Listed::LayerNormAndBiasTwice}) {
    for (bool unfreeze_later : {false, true}) {
      step(
          tp, listed,
          [&](Block& b, int r) {
            const std::string at = " (tp " + std::to_string(tp) + ", rank " + std::to_string(r) +
                                   (unfreeze_later ? ", bias unfrozen after construction)" : ")");
            expect_close(b->ln->weight.grad(), want[0], "LayerNorm weight" + at);
            expect_close(b->ln->bias.grad(), want[1], "LayerNorm bias" + at);
            expect_close(b->in->weight.grad(), split_along(want[2], 0, r, tp, "w1"), "w1" + at);
            expect_close(b->in->bias.grad(), split_along(want[3], 0, r, tp, "b1"), "b1" + at);
            expect_close(b->out->weight.grad(), split_along(want[4], 1, r, tp, "w2"), "w2" + at);
            expect_close(b->out->bias.grad(), want[5], "row-parallel bias" + at);
          },
          unfreeze_later);
    }
  }
}

TEST_P(SequenceParallelSync, ALayerNormLeftOutIsRefusedOnEveryRank) {
  const int tp = GetParam();
  const auto x = randn({kSeq, kHidden}, 1), c = randn({kSeq, kHidden}, 2);
  auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
    Block block(mesh["tp"]);
    cohort::GradientSynchronizer sync(mesh, block.ptr(), {}, torch::Tensor());
    const int r = world->rank();
    sync.prepare_forward();
    auto y = block(split_along(x, 0, r, tp, "x").clone());
    sync.after_forward({y});
    (y * split_along(c, 0, r, tp, "c")).sum().backward();
    sync.finish_backward();
  });
  for (int r = 0; r < tp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    if (tp == 1) {  // one rank sees the whole sequence: nothing is partial
      EXPECT_EQ(e, kNoError);
      continue;
    }
    EXPECT_NE(e.find("GradientSynchronizer (rank " + std::to_string(r) + "): "), std::string::npos)
        << e;
    EXPECT_NE(e.find("the gradient of parameter 'ln.weight', whole on every TP rank, differs "
                     "across TP ranks"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("list it in sequence_parallel_parameters"), std::string::npos) << e;
  }
}

// Two pipeline stages, the first with its LayerNorm left out: the second
// stage's ranks are refused too (else they would wait for the first's
// activations until the timeout).
TEST_P(SequenceParallelSync, OneStageLeavingItOutIsRefusedOnEveryStage) {
  const int tp = GetParam();
  if (tp == 1) GTEST_SKIP() << "nothing is partial at tp 1";
  const auto x = randn({kSeq, kHidden}, 1), c = randn({kSeq, kHidden}, 2);
  auto errors = errors_on_every_rank(2 * tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {2, 1, tp}, {"pp", "dp", "tp"});
    Block block(mesh["tp"]);
    // The two ends of a pipeline share an embedding; here one that takes
    // no part in the loss but gets a (zero) gradient like the others.
    auto emb = block->register_parameter("emb", torch::zeros({kHidden}));
    std::vector<torch::Tensor> sp;
    if (mesh["pp"].process_group()->rank() == 1) sp = {block->ln->weight, block->ln->bias};
    cohort::GradientSynchronizer sync(mesh, block.ptr(), sp, emb);
    const int r = mesh["tp"].process_group()->rank();
    sync.prepare_forward();
    auto y = block(split_along(x, 0, r, tp, "x").clone()) + emb * 0;
    sync.after_forward({y});
    (y * split_along(c, 0, r, tp, "c")).sum().backward();
    sync.finish_backward();
  });
  for (int r = 0; r < 2 * tp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("GradientSynchronizer (rank " + std::to_string(r) + "): "), std::string::npos)
        << e;
    const std::string want = r < tp ? "the gradient of parameter 'ln.weight', whole on every TP "
                                      "rank, differs across TP ranks"
                                    : "pipeline stage 0 (its rank in this rank's \"pp\" group) "
                                      "found a parameter whole on every TP rank";
    EXPECT_NE(e.find(want), std::string::npos) << "rank " << r << ": " << e;
  }
}

TEST_P(SequenceParallelSync, ATensorOutsideTheStageIsRefusedOnEveryRank) {
  const int tp = GetParam();
  auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
    Block block(mesh["tp"]), other(mesh["tp"]);
    cohort::GradientSynchronizer sync(mesh, block.ptr(), {block->ln->weight, other->ln->bias},
                                      torch::Tensor());
  });
  for (int r = 0; r < tp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("GradientSynchronizer (rank " + std::to_string(r) +
                     "): sequence-parallel parameter 1 is not a parameter of the stage"),
              std::string::npos)
        << e;
  }
}

// A TP rank's part of a split tensor summed over TP would mix the parts.
TEST_P(SequenceParallelSync, ASplitParameterListedIsRefusedOnEveryRank) {
  const int tp = GetParam();
  auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
    Block block(mesh["tp"]);
    cohort::GradientSynchronizer sync(mesh, block.ptr(), {block->ln->weight, block->in->bias},
                                      torch::Tensor());
  });
  for (int r = 0; r < tp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("GradientSynchronizer (rank " + std::to_string(r) +
                     "): sequence-parallel parameter 1 is split over TP"),
              std::string::npos)
        << e;
  }
}

// A LayerNorm before the scatter to the sequence-parallel region sees the
// whole sequence on every rank: its gradient is whole already, and listing
// it would multiply it by tp.
TEST_P(SequenceParallelSync, AParameterThatSeesWholeActivationsListedIsRefusedOnEveryRank) {
  const int tp = GetParam();
  const auto x = randn({kSeq, kHidden}, 1), c = randn({kSeq, kHidden}, 2);
  auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
    Block block(mesh["tp"]);
    auto pre =
        block->register_module("pre", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    cohort::GradientSynchronizer sync(
        mesh, block.ptr(), {block->ln->weight, block->ln->bias, pre->weight}, torch::Tensor());
    const int r = world->rank();
    sync.prepare_forward();
    auto y =
        block(scatter_to_sequence_parallel_region(pre->forward(x), *mesh["tp"].process_group()));
    sync.after_forward({y});
    (y * split_along(c, 0, r, tp, "c")).sum().backward();
    sync.finish_backward();
  });
  for (int r = 0; r < tp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    if (tp == 1) {  // one rank: nothing is summed, nothing multiplied
      EXPECT_EQ(e, kNoError);
      continue;
    }
    EXPECT_NE(e.find("GradientSynchronizer (rank " + std::to_string(r) +
                     "): after the reduction, sequence-parallel parameter 2 has the same "
                     "gradient on every TP rank"),
              std::string::npos)
        << e;
  }
}

// Replicas drawn apart (each rank seeding its own generator) are refused
// at construction, a frozen one too.
TEST_P(SequenceParallelSync, ReplicasWhoseValuesDifferAreRefusedOnEveryRank) {
  const int tp = GetParam();
  for (bool frozen : {false, true}) {
    auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> world) {
      auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
      Block block(mesh["tp"]);
      torch::NoGradGuard no_grad;
      block->ln->weight.add_(0.01 * world->rank());
      block->ln->weight.requires_grad_(!frozen);
      cohort::GradientSynchronizer sync(mesh, block.ptr(), {block->ln->bias}, torch::Tensor());
    });
    for (int r = 0; r < tp; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      if (tp == 1) {
        EXPECT_EQ(e, kNoError);
        continue;
      }
      EXPECT_NE(e.find("GradientSynchronizer (rank " + std::to_string(r) +
                       "): the values of parameter 'ln.weight', whole on every TP rank, differ "
                       "across TP ranks"),
                std::string::npos)
          << (frozen ? "frozen: " : "") << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, SequenceParallelSync, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::sequence_parallel_sync_test
