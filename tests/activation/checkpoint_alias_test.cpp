// checkpoint's outputs that share memory, with each other (a tensor and a
// view of it, the same tensor twice, overlapping views of a tensor the
// function does not return) or with an input, and are changed in place
// after the call. Autograd must see them as the views they are, as it does
// without checkpoint: each case compares the gradients of the input and
// the weight with the same function run plainly in the same process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/activation/checkpoint.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::checkpoint_alias_test {
namespace {

using Tensors = std::vector<torch::Tensor>;

struct AliasCase {
  std::string name;
  // The function's outputs, from its hidden h = sin(x @ w) of shape [3, 4].
  std::function<Tensors(const torch::Tensor& h)> outputs;
  // What the caller does with them: in-place changes, then the loss.
  std::function<torch::Tensor(Tensors& out)> use;
};

std::vector<AliasCase> alias_cases() {
  using torch::Tensor;
  return {
      {"view_of_changed_output",
       [](const Tensor& h) {
         return Tensors{h, h.narrow(0, 0, 1)};
       },
       [](Tensors& out) {
         out[0].mul_(2);
         return weighted_loss(out[1]);
       }},
      {"same_tensor_twice",
       [](const Tensor& h) {
         return Tensors{h, h};
       },
       [](Tensors& out) {
         out[0].add_(1).mul_(3);
         return weighted_loss(out[1]);
       }},
      {"base_of_changed_view",
       [](const Tensor& h) {
         return Tensors{h.narrow(1, 1, 2), h};
       },
       [](Tensors& out) {
         out[0].sin_();
         return weighted_loss(out[1]);
       }},
      // Both used, nothing changed: a shared element's gradient counted once
      // per use, not once per output that covers it.
      {"both_used",
       [](const Tensor& h) {
         return Tensors{h, h.narrow(0, 1, 2)};
       },
       [](Tensors& out) { return weighted_loss(out[0]) + weighted_loss(out[1]); }},
      {"overlapping_views_of_a_hidden_tensor",
       [](const Tensor& h) {
         return Tensors{h.narrow(0, 0, 2), h.narrow(0, 1, 2)};
       },
       [](Tensors& out) {
         out[1].mul_(3);
         return weighted_loss(out[0]) + weighted_loss(out[1]);
       }},
      {"transposed_and_expanded",
       [](const Tensor& h) {
         return Tensors{h.t(), h.unsqueeze(0).expand({2, 3, 4})};
       },
       [](Tensors& out) {
         out[0].add_(1).sin_();
         return weighted_loss(out[0]) + weighted_loss(out[1]);
       }},
  };
}

::testing::AssertionResult close(const char* what, const torch::Tensor& got,
                                 const torch::Tensor& want) {
  if (!got.defined() || !want.defined())
    return ::testing::AssertionFailure() << what << " undefined on one side";
  if (torch::allclose(got, want, 1e-5, 1e-6)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": sum " << got.sum().item<double>() << " against " << want.sum().item<double>()
         << " without checkpoint (max difference " << (got - want).abs().max().item<double>()
         << ")";
}

class CheckpointAliasedOutputs : public ::testing::TestWithParam<AliasCase> {};

TEST_P(CheckpointAliasedOutputs, GradientsAreThoseWithout) {
  torch::set_num_threads(1);
  auto gen = at::detail::createCPUGenerator(5);
  const auto x0 = torch::randn({3, 4}, gen), w0 = torch::randn({4, 4}, gen);
  Tensors x_grad, w_grad;
  for (bool checkpointed : {false, true}) {
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto outputs = GetParam().outputs;
    CheckpointFunction fn = [w, outputs](const Tensors& in) {
      return outputs(torch::sin(torch::matmul(in[0], w)));
    };
    Tensors out = checkpointed ? checkpoint(fn, {x}, {w}) : fn({x});
    GetParam().use(out).backward();
    x_grad.push_back(x.grad()), w_grad.push_back(w.grad());
  }
  EXPECT_TRUE(close("x.grad", x_grad[1], x_grad[0]));
  EXPECT_TRUE(close("w.grad", w_grad[1], w_grad[0]));
}

INSTANTIATE_TEST_SUITE_P(Cases, CheckpointAliasedOutputs, ::testing::ValuesIn(alias_cases()),
                         [](const auto& info) { return info.param.name; });

// An output that is a view of an input, changed in place: the input changes
// with it, as without checkpoint, and the gradient flows through the view.
TEST(CheckpointAliasedInput, ViewOfInputChangedInPlace) {
  Tensors grads;
  for (bool checkpointed : {false, true}) {
    auto x = torch::arange(8, torch::kFloat).reshape({2, 4}).requires_grad_(true);
    auto xx = x * 1;  // not a leaf, so it may be changed in place
    CheckpointFunction fn = [](const Tensors& in) { return Tensors{in[0].view({-1})}; };
    Tensors out = checkpointed ? checkpoint(fn, {xx}) : fn({xx});
    out[0].mul_(2);
    EXPECT_TRUE(torch::equal(xx, x.detach() * 2));
    weighted_loss(out[0]).backward();
    grads.push_back(x.grad());
  }
  EXPECT_TRUE(close("x.grad", grads[1], grads[0]));
}

// A view of an input returned beside a computed output, nothing changed:
// both gradients reach the input and the weight.
TEST(CheckpointAliasedInput, ViewOfInputBesideComputedOutput) {
  auto gen = at::detail::createCPUGenerator(6);
  const auto x0 = torch::randn({3, 4}, gen), w0 = torch::randn({4, 4}, gen);
  Tensors x_grad, w_grad;
  for (bool checkpointed : {false, true}) {
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    CheckpointFunction fn = [w](const Tensors& in) {
      return Tensors{in[0].narrow(0, 1, 2), torch::tanh(torch::matmul(in[0], w))};
    };
    Tensors out = checkpointed ? checkpoint(fn, {x}, {w}) : fn({x});
    (weighted_loss(out[0]) + weighted_loss(out[1])).backward();
    x_grad.push_back(x.grad()), w_grad.push_back(w.grad());
  }
  EXPECT_TRUE(close("x.grad", x_grad[1], x_grad[0]));
  EXPECT_TRUE(close("w.grad", w_grad[1], w_grad[0]));
}

// Changing a view of an input changes the input, which the recompute of the
// other outputs would read: that backward throws rather than differentiate
// another function.
TEST(CheckpointAliasedInput, RecomputeAfterTheInputChangedThrows) {
  auto x = torch::randn({3, 4}).requires_grad_(true), w = torch::randn({4, 4}).requires_grad_(true);
  auto xx = x * 1;
  auto out = checkpoint(
      [w](const Tensors& in) {
        return Tensors{in[0].view({-1}), torch::matmul(in[0], w)};
      },
      {xx}, {w});
  out[0].mul_(2);
  try {
    (out[0].sum() + out[1].sum()).backward();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cohort::testing::checkpoint_alias_test
