// The optimizer-state key: after a step of each LibTorch optimizer cohort
// knows, optimizer_state_key finds the state of every parameter that took a
// gradient, and that state is the parameter's own (its shape). A key spelled
// otherwise than the running LibTorch spells it finds nothing, silently, and
// dcp and ZeRO checkpoints would drop the state.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <set>
#include <string>

#include "cohort/core/torch_compat.h"
#include "cohort/optim/optimizer_state.h"

namespace cohort::testing::state_key_test {
namespace {

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<torch::Tensor>&)>;

struct Kind {
  std::string name;
  MakeOptimizer make;
};

template <class Optimizer, class Options>
Kind kind(std::string name, Options options) {
  return {std::move(name), [options](const std::vector<torch::Tensor>& params) {
            return std::make_unique<Optimizer>(params, options);
          }};
}

std::vector<Kind> kinds() {
  using namespace torch::optim;
  return {kind<SGD>("SGD", SGDOptions(0.1).momentum(0.9)), kind<Adam>("Adam", AdamOptions(0.1)),
          kind<AdamW>("AdamW", AdamWOptions(0.1)), kind<RMSprop>("RMSprop", RMSpropOptions(0.1)),
          kind<Adagrad>("Adagrad", AdagradOptions(0.1))};
}

void PrintTo(const Kind& kind, std::ostream* os) { *os << kind.name; }

class StateKey : public ::testing::TestWithParam<Kind> {};

TEST_P(StateKey, FindsTheStateOfEverySteppedParameter) {
  // Sizes 0, 1 and more; every parameter gets a gradient.
  std::vector<torch::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{0}, {1}, {3, 4}, {5}}) {
    auto p = torch::arange(1, torch::tensor(shape).prod().item<int64_t>() + 1, torch::kFloat)
                 .reshape(shape)
                 .requires_grad_();
    params.push_back(p);
  }
  auto optimizer = GetParam().make(params);
  optimizer->zero_grad();
  torch::Tensor loss = torch::zeros({});
  for (const auto& p : params) loss = loss + (p * p).sum();
  loss.backward();
  optimizer->step();

  std::set<OptimizerStateKey> keys;
  for (const auto& p : params) {
    const auto key = optimizer_state_key(p);
    keys.insert(key);
    const auto it = optimizer->state().find(key);
    ASSERT_NE(it, optimizer->state().end())
        << GetParam().name << ": no state for a parameter of " << p.sizes();
    const auto tensors = state_tensors(*it->second);
    ASSERT_FALSE(tensors.empty());
    for (const auto& [name, t] : tensors) EXPECT_EQ(t.sizes(), p.sizes()) << name;
  }
  EXPECT_EQ(keys.size(), params.size()) << "two parameters share a key";
  EXPECT_EQ(optimizer->state().size(), params.size());
  // A tensor the optimizer does not hold has no state under its key.
  const auto stranger = torch::ones({3, 4});
  EXPECT_EQ(optimizer->state().find(optimizer_state_key(stranger)), optimizer->state().end());
}

INSTANTIATE_TEST_SUITE_P(EveryOptimizer, StateKey, ::testing::ValuesIn(kinds()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace cohort::testing::state_key_test
