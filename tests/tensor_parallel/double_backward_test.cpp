// Second derivatives through cohort's autograd functions. A gradient penalty
// (the input gradient taken with create_graph, its square summed, then
// backward) through a replicated layer and a TP MLP, at tp = 1..3, plain,
// sequence-parallel and with the output gathered and scattered again,
// against the dense model on one process: every mapping's gradient is
// differentiable and exact. The functions whose gradients are computed
// outside autograd (ring attention, the MoE exchange, the vocab-parallel
// cross-entropy, checkpoint) give the same first-order gradients under
// create_graph, and a second backward through them throws instead of
// silently leaving their terms out.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>

#include "cohort/activation/checkpoint.h"
#include "cohort/context_parallel/layout.h"
#include "cohort/context_parallel/ring_attention.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "support/tensor_checks.h"
#include "support/thread_ranks.h"

namespace cohort::testing::double_backward_test {
namespace {

using namespace cohort::tensor_parallel;

torch::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  return torch::randn(sizes, at::detail::createCPUGenerator(seed));
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  cohort::testing::expect_allclose(got, want, what, 1e-4, 1e-5);
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

constexpr int64_t kSeq = 6, kBatch = 2, kIn = 4, kHidden = 12;

// The penalty P = sum((dL/dx)^2) with L = sum(y * c); backward of P.
torch::Tensor penalty(const torch::Tensor& loss, const torch::Tensor& x, torch::Tensor* grad_x) {
  auto g = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  *grad_x = g.detach().clone();
  return (g * g).sum();
}

struct Dense {
  torch::Tensor w0, w1, b1, w2, b2, x, grad_x;
  Dense() {
    w0 = randn({kIn, kIn}, 4).requires_grad_();
    auto [a, b] = master_linear_weights(kIn, kHidden, 5);
    auto [c, d] = master_linear_weights(kHidden, kIn, 6);
    w1 = a.requires_grad_(), b1 = b.requires_grad_(), w2 = c.requires_grad_(),
    b2 = d.requires_grad_();
    x = randn({kSeq, kBatch, kIn}, 1).requires_grad_();
    auto h = torch::gelu(torch::linear(torch::linear(x, w0), w1, b1));
    auto y = torch::linear(h, w2, b2);
    penalty((y * randn(y.sizes(), 2)).sum(), x, &grad_x).backward();
  }
};

enum class Mode { Plain, SequenceParallel, Gathered };

struct Param {
  int tp;
  Mode mode;
};

class DoubleBackward : public ::testing::TestWithParam<Param> {};

TEST_P(DoubleBackward, GradientPenaltyThroughTensorParallelMatchesDense) {
  const auto [tp, mode] = GetParam();
  const Dense dense;
  const bool sp = mode == Mode::SequenceParallel;
  const auto c = randn({kSeq, kBatch, kIn}, 2);
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    const int r = g->rank();
    auto mesh = DeviceMesh::from_group(g, "tp");
    ColumnParallelLinearOptions co;
    co.seed = 5, co.sequence_parallel = sp, co.gather_output = mode == Mode::Gathered;
    RowParallelLinearOptions ro;
    ro.seed = 6, ro.sequence_parallel = sp, ro.input_is_parallel = mode != Mode::Gathered;
    ColumnParallelLinear column(mesh, kIn, kHidden, co);
    RowParallelLinear row(mesh, kHidden, kIn, ro);
    auto w0 = randn({kIn, kIn}, 4).requires_grad_();
    // Under sequence parallelism each rank holds its slice of the sequence.
    auto seq = [&](const torch::Tensor& t) { return sp ? split_along(t, 0, r, tp, "seq") : t; };
    auto x = seq(dense.x.detach()).clone().requires_grad_();
    auto y = row(torch::gelu(column(torch::linear(x, w0))));
    torch::Tensor grad_x;
    penalty((y * seq(c)).sum(), x, &grad_x).backward();
    expect_close(grad_x, seq(dense.grad_x), "first-order input gradient");
    expect_close(x.grad(), seq(dense.x.grad()), "input gradient");
    // Replicated weights that saw only this rank's slice of the sequence
    // hold a partial gradient (summed over TP, as the layers document).
    auto whole = [&](torch::Tensor t) {
      if (sp && tp > 1) g->all_reduce(t).wait();
      return t;
    };
    expect_close(whole(w0.grad().clone()), dense.w0.grad(), "replicated weight");
    expect_close(column->weight.grad(), split_along(dense.w1.grad(), 0, r, tp, "w1"),
                 "column weight");
    expect_close(column->bias.grad(), split_along(dense.b1.grad(), 0, r, tp, "b1"), "column bias");
    expect_close(row->weight.grad(), split_along(dense.w2.grad(), 1, r, tp, "w2"), "row weight");
    if (row->bias.grad().defined())
      expect_close(whole(row->bias.grad().clone()), dense.b2.grad(), "row bias");
  });
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (int tp : {1, 2, 3})
    for (Mode m : {Mode::Plain, Mode::SequenceParallel, Mode::Gathered}) out.push_back({tp, m});
  return out;
}

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  const char* modes[] = {"plain", "sequence_parallel", "gathered"};
  return "tp" + std::to_string(info.param.tp) + "_" + modes[static_cast<int>(info.param.mode)];
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, DoubleBackward, ::testing::ValuesIn(params()), name_of);

// f(x) on every rank under create_graph: the input gradient equals a plain
// backward's, and (`once`) backward through it throws naming `name`, or
// (not `once`) runs.
void expect_gradients(const std::function<torch::Tensor(const torch::Tensor&)>& f,
                      const torch::Tensor& input, const std::string& name, bool once = true) {
  auto x = input.clone().requires_grad_();
  auto y = f(x);
  const auto c = randn(y.sizes(), 7);
  (y * c).sum().backward();
  const auto plain = x.grad().clone();
  auto x2 = input.clone().requires_grad_();
  auto g = torch::autograd::grad({(f(x2) * c).sum()}, {x2}, {}, true, /*create_graph=*/true)[0];
  expect_close(g.detach(), plain, name + ": first-order gradient");
  if (!once) {
    (g * g).sum().backward();
    return;
  }
  try {
    (g * g).sum().backward();
    ADD_FAILURE() << name << ": a second backward through it did not throw";
  } catch (const std::exception& e) {
    EXPECT_TRUE(has(e.what(), "cohort: " + name + " is differentiable once")) << e.what();
  }
}

class DifferentiableOnce : public ::testing::TestWithParam<int> {};

TEST_P(DifferentiableOnce, RingAttention) {
  const int cp = GetParam();
  const auto full = randn({1, 2, 4 * cp, 4}, 11);
  run_ranks_shared(cp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    const auto mine = context_parallel::shard_sequence(full, g->rank(), cp);
    const auto k = mine * 0.5, v = mine.flip(3);
    expect_gradients(
        [&](const torch::Tensor& q) { return context_parallel::ring_attention(q, k, v, g); }, mine,
        "ring_attention");
  });
}

TEST_P(DifferentiableOnce, MoeExchange) {
  const int ep = GetParam();
  run_ranks_shared(ep, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    expert_parallel::MoEOptions o;
    o.hidden = 4, o.ffn = 6, o.experts = 6, o.top_k = 2, o.capacity_factor = 6, o.ep_group = g;
    expert_parallel::MoE moe(o);
    // One rank exchanges nothing: its graph is plain LibTorch ops.
    expect_gradients([&](const torch::Tensor& x) { return moe(x); },
                     randn({5, 4}, 20 + static_cast<uint64_t>(g->rank())),
                     "the MoE's all-to-all exchange", /*once=*/ep > 1);
  });
}

TEST_P(DifferentiableOnce, VocabParallelCrossEntropy) {
  const int tp = GetParam();
  const auto logits = randn({3, 2 * tp}, 30);
  const auto target = torch::randint(2 * tp, {3}, at::detail::createCPUGenerator(31));
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    expect_gradients(
        [&](const torch::Tensor& z) { return vocab_parallel_cross_entropy(z, target, *g); },
        split_along(logits, 1, g->rank(), tp, "z").clone(), "vocab_parallel_cross_entropy");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DifferentiableOnce, ::testing::Values(1, 2, 3));

TEST(DifferentiableOnceAlone, Checkpoint) {
  const auto w = randn({4, 4}, 40).requires_grad_();
  expect_gradients(
      [&](const torch::Tensor& x) {
        return cohort::checkpoint(
            [w](const torch::Tensor& t) { return torch::tanh(torch::linear(t, w)); }, x, {w});
      },
      randn({3, 4}, 41), "checkpoint");
}

}  // namespace
}  // namespace cohort::testing::double_backward_test
