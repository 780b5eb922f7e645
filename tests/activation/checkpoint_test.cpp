// checkpoint in one process: gradients bitwise equal to the same model run
// without it (an MLP, a transformer block with dropout), the RNG stream, the
// zero-bubble split of one backward into input and weight passes, the edge
// cases of inputs and outputs, and every refused use.
#include "cohort/activation/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/core/error.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::checkpoint_test {
namespace {

using Tensors = std::vector<torch::Tensor>;

struct ModelCase {
  std::string name;
  std::function<torch::nn::Sequential()> make;
  std::vector<int64_t> input_shape;
};

std::vector<ModelCase> model_cases() {
  return {
      {"mlp", [] { return make_mlp(4, 16); }, {8, 16}},
      {"transformer_dropout", [] { return make_transformer(2, 16, 4, 0.2); }, {2, 6, 16}},
  };
}

struct Outcome {
  Tensors grads;        // the parameters', then the input's
  torch::Tensor after;  // a draw from the global generator after backward
};

// Forward and backward from seed 42, through `model` (the original) or its
// checkpointed blocks (sharing the same parameters).
Outcome run(const torch::nn::Sequential& model, const torch::Tensor& input, bool checkpointed,
            CheckpointOptions options = {}) {
  auto net = checkpointed ? checkpoint_blocks(model, options) : model;
  auto x = input.clone().requires_grad_(true);
  torch::manual_seed(42);
  weighted_loss(net->forward(x)).backward();
  Outcome r;
  r.after = torch::rand({16});
  auto params = model->parameters();
  params.push_back(x);
  r.grads = take_grads(params);
  return r;
}

class CheckpointEquivalence : public ::testing::TestWithParam<ModelCase> {};

TEST_P(CheckpointEquivalence, GradientsAreBitwiseThoseWithout) {
  torch::set_num_threads(1);
  auto model = GetParam().make();
  auto x = torch::randn(GetParam().input_shape, at::detail::createCPUGenerator(9));
  const Outcome plain = run(model, x, false), ckpt = run(model, x, true);
  EXPECT_TRUE(bitwise_equal(ckpt.grads, plain.grads));
  // The recompute ran from the forward's RNG state and gave the caller's back.
  EXPECT_TRUE(torch::equal(ckpt.after, plain.after));
}

// Without RNG preservation the recompute draws other dropout masks: the
// gradients differ, which is what preserve_rng_state exists to prevent.
TEST(Checkpoint, WithoutRngPreservationDropoutDiffers) {
  torch::set_num_threads(1);
  auto model = make_transformer(2, 16, 4, 0.2);
  auto x = torch::randn({2, 6, 16}, at::detail::createCPUGenerator(9));
  CheckpointOptions off;
  off.preserve_rng_state = false;
  EXPECT_FALSE(bitwise_equal(run(model, x, true, off).grads, run(model, x, false).grads));
}

INSTANTIATE_TEST_SUITE_P(Models, CheckpointEquivalence, ::testing::ValuesIn(model_cases()),
                         [](const auto& info) { return info.param.name; });

// Zero-bubble's split: the input gradient first (retaining the graph), the
// weights' later. Each pass recomputes and differentiates only its part, so
// together they give what one backward gives.
TEST(Checkpoint, InputThenWeightPassesMatchOneBackward) {
  torch::set_num_threads(1);
  auto model = make_transformer(1, 16, 4, 0.2);
  auto x = torch::randn({2, 6, 16}, at::detail::createCPUGenerator(9)).requires_grad_(true);
  auto params = model->parameters();
  torch::manual_seed(1);
  auto plain = torch::autograd::grad({weighted_loss(model->forward(x))}, {x});
  torch::manual_seed(1);
  auto plain_w = torch::autograd::grad({weighted_loss(model->forward(x))}, params);
  torch::manual_seed(1);
  auto loss = weighted_loss(checkpoint_wrapper(model)->forward(x));
  auto input_grad = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true);
  auto weight_grads = torch::autograd::grad({loss}, params);
  EXPECT_TRUE(bitwise_equal(input_grad, plain));
  EXPECT_TRUE(bitwise_equal(weight_grads, plain_w));
}

// Inputs of every kind: one requiring grad, one not, an integer mask, an
// undefined tensor; outputs: a floating one, the integer mask passed
// through, an undefined one, and a constant that depends on nothing.
TEST(Checkpoint, InputsAndOutputsOfEveryKind) {
  torch::set_num_threads(1);
  torch::nn::Linear lin(6, 6);
  init_parameters(*lin, 4);
  auto fn = [lin](const Tensors& in) mutable {
    auto h = torch::tanh(lin(in[0]) + in[1]) * in[2].to(torch::kFloat32);
    return Tensors{h, in[2], torch::Tensor(), torch::ones({3})};
  };
  auto gen = at::detail::createCPUGenerator(2);
  auto a = torch::randn({4, 6}, gen), b = torch::randn({4, 6}, gen);
  auto mask = (torch::arange(24).reshape({4, 6}) % 3 != 0).to(torch::kInt64);
  auto params = lin->parameters();
  auto all = params;
  auto x = a.clone().requires_grad_(true);
  all.push_back(x);

  auto out = fn({x, b, mask, torch::Tensor()});
  (weighted_loss(out[0]) + out[3].sum()).backward();
  auto expected = take_grads(all);

  out = checkpoint(fn, {x, b, mask, torch::Tensor()}, params);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_TRUE(torch::equal(out[1], mask));
  EXPECT_FALSE(out[1].requires_grad());
  EXPECT_FALSE(out[2].defined());
  (weighted_loss(out[0]) + out[3].sum()).backward();  // out[3]'s gradient goes nowhere
  EXPECT_TRUE(bitwise_equal(take_grads(all), expected));
}

// A parameter the function does not use gets no gradient, as without.
TEST(Checkpoint, UnusedParameterGetsNoGradient) {
  torch::nn::Linear used(4, 4), spare(4, 4);
  auto params = used->parameters();
  params.push_back(spare->weight);
  auto y = checkpoint([used](const torch::Tensor& x) mutable { return used(x); },
                      torch::randn({2, 4}), params);
  y.sum().backward();
  EXPECT_TRUE(used->weight.grad().defined());
  EXPECT_FALSE(spare->weight.grad().defined());
}

// Under no grad (evaluation) it is the function itself: no graph.
TEST(Checkpoint, NoGradModeRunsTheFunctionOnly) {
  torch::nn::Linear lin(4, 4);
  int calls = 0;
  torch::NoGradGuard no_grad;
  auto y = checkpoint(
      [&calls, lin](const torch::Tensor& x) mutable {
        ++calls;
        return lin(x);
      },
      torch::randn({2, 4}), lin->parameters());
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
}

// A graph retained through a backward can be differentiated again, and
// recomputes again: the second backward accumulates the same gradient.
TEST(Checkpoint, RetainedGraphRecomputesEachBackward) {
  torch::set_num_threads(1);
  auto model = make_mlp(2, 8);
  int calls = 0;
  auto x = torch::randn({3, 8}, at::detail::createCPUGenerator(1));
  auto y = checkpoint(
      [&calls, model](const torch::Tensor& t) mutable {
        ++calls;
        return model->forward(t);
      },
      x, model->parameters());
  auto loss = weighted_loss(y);
  loss.backward({}, /*retain_graph=*/true);
  auto once = take_grads(model->parameters());
  loss.backward();
  EXPECT_TRUE(bitwise_equal(take_grads(model->parameters()), once));
  EXPECT_EQ(calls, 3);  // forward, then once per backward
}

// --- refused uses: each an InvalidArgument naming checkpoint ---------------

struct ErrorCase {
  std::string name;
  std::function<void()> body;
  std::string expected;  // part of the message
};

// fn's output on its n-th call (the forward is call 0, the recompute call 1).
CheckpointFunction changing(std::function<Tensors(const Tensors&, int)> per_call) {
  auto calls = std::make_shared<int>(0);
  return [calls, per_call](const Tensors& in) { return per_call(in, (*calls)++); };
}

void backward_of(const Tensors& out) {
  torch::Tensor loss;
  for (const auto& t : out)
    if (t.defined() && t.requires_grad()) loss = loss.defined() ? loss + t.sum() : t.sum();
  loss.backward();
}

torch::Tensor leaf() { return torch::randn({2, 3}).requires_grad_(true); }

std::vector<ErrorCase> error_cases() {
  return {
      {"no_function", [] { checkpoint(CheckpointFunction(), {leaf()}); }, "no function"},
      {"no_floating_output",
       [] { checkpoint([](const Tensors& in) { return Tensors{in[0].argmax()}; }, {leaf()}); },
       "no floating-point tensor"},
      {"recompute_without_grad",
       [] {
         backward_of(
             checkpoint([](const Tensors& in) { return Tensors{in[0].detach() * 2}; }, {leaf()}));
       },
       "no tensor that requires grad"},
      {"shape_changes",
       [] {
         backward_of(checkpoint(changing([](const Tensors& in, int call) {
                                  return Tensors{call == 0 ? in[0] * 2 : in[0].narrow(1, 0, 2) * 2};
                                }),
                                {leaf()}));
       },
       "output 0 is Float [2, 2], the forward's was Float [2, 3]"},
      {"dtype_changes",
       [] {
         backward_of(checkpoint(changing([](const Tensors& in, int call) {
                                  return Tensors{call == 0 ? in[0] * 2 : in[0].to(torch::kDouble)};
                                }),
                                {leaf()}));
       },
       "output 0 is Double [2, 3], the forward's was Float [2, 3]"},
      {"count_changes",
       [] {
         backward_of(checkpoint(changing([](const Tensors& in, int call) {
                                  return call == 0 ? Tensors{in[0] * 2} : Tensors{in[0], in[0]};
                                }),
                                {leaf()}));
       },
       "returned 2 tensors, the forward 1"},
      {"parameter_not_passed",
       [] {
         torch::nn::Linear lin(3, 3);
         backward_of(checkpoint([lin](const Tensors& in) mutable { return Tensors{lin(in[0])}; },
                                {leaf()}));
       },
       "neither an input nor in params"},
      {"function_changes_its_input",
       [] {
         checkpoint(
             [](const Tensors& in) {
               in[0].mul_(2);
               return Tensors{in[0] * 1};
             },
             {leaf()});
       },
       "changed its input or parameter 0"},
      {"shared_memory_of_two_dtypes",
       [] {
         checkpoint(
             [](const Tensors& in) {
               auto c = torch::complex(in[0], in[0] * 2);
               return Tensors{c, torch::view_as_real(c)};
             },
             {leaf()});
       },
       "outputs 0 and 1 share memory but are ComplexFloat and Float"},
      {"second_backward",
       [] {
         auto y = checkpoint([](const Tensors& in) { return Tensors{in[0] * in[0]}; }, {leaf()});
         y[0].sum().backward();
         y[0].sum().backward();
       },
       "a second time"},
      {"wrapper_of_nothing", [] { checkpoint_wrapper(torch::nn::AnyModule()); }, "no module"},
  };
}

class CheckpointErrors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(CheckpointErrors, AreInvalidArgumentsNamingCheckpoint) {
  try {
    GetParam().body();
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(GetParam().expected), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CheckpointErrors, ::testing::ValuesIn(error_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace cohort::testing::checkpoint_test
