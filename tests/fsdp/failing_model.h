// defines: make_model's model with a layer that fails on demand, for the
// tests of an exception inside FSDP's forward or backward: the identity
// while a shared flag is clear, and while it is set it throws in forward
// (FailingForward) or in its gradient's hook (FailingHook).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <stdexcept>

#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::fsdp_test {

// What the failing layers throw: types of their own, so that a test
// catching one sees that it was not replaced on the way out.
struct LayerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct HookError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The identity, or it throws LayerError while `fail` is set.
struct FailingForwardImpl : torch::nn::Module {
  std::shared_ptr<bool> fail;
  explicit FailingForwardImpl(std::shared_ptr<bool> f) : fail(std::move(f)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (*fail) throw LayerError("the layer refused its input");
    return x;
  }
};
TORCH_MODULE(FailingForward);

// The identity whose gradient's hook throws HookError while `fail` is set.
struct FailingHookImpl : torch::nn::Module {
  std::shared_ptr<bool> fail;
  explicit FailingHookImpl(std::shared_ptr<bool> f) : fail(std::move(f)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (!x.requires_grad()) return x;
    auto h = x.view_as(x);
    auto flag = fail;
    h.register_hook([flag](const torch::Tensor& g) {
      if (*flag) throw HookError("the hook refused its gradient");
      return g;
    });
    return h;
  }
};
TORCH_MODULE(FailingHook);

// Where the failing layer is.
enum class Where {
  kBetweenUnits,  // after the first inner unit
  kInsideUnit,    // inside the second inner unit, after its Linear
};

// A Linear, with the failing layer after it when `fail` is given.
template <class Failing>
struct FailingBlockImpl : torch::nn::Module {
  Linear linear{nullptr};
  Failing failing{nullptr};
  FailingBlockImpl(int64_t in, int64_t out, const std::shared_ptr<bool>& fail) {
    linear = register_module("linear", Linear(in, out));
    if (fail) failing = register_module("failing", Failing(fail));
    to(test_device());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = linear(x);
    return failing ? failing(h) : h;
  }
};

// make_model's model with the failing layer `where` says, each Linear in a
// block of its own (a unit over `comm`, or plain when `comm` is null).
template <class Failing>
Sequential make_failing_model(const std::shared_ptr<Communicator>& comm, FullyShardOptions options,
                              Where where, const std::shared_ptr<bool>& fail) {
  using Block = torch::nn::ModuleHolder<FailingBlockImpl<Failing>>;
  auto unit = [&](Block b) {
    if (!comm) return AnyModule(b);
    return AnyModule(FullyShard(AnyModule(b), comm, options));
  };
  const auto device = test_device();
  auto tied = torch::zeros({5, 7}, device);
  Sequential seq;
  seq->push_back(InProj(tied));
  seq->push_back(Tanh());
  seq->push_back(unit(Block(7, 6, nullptr)));
  if (where == Where::kBetweenUnits) seq->push_back(Failing(fail));
  seq->push_back(Tanh());
  seq->push_back(unit(Block(6, 7, where == Where::kInsideUnit ? fail : nullptr)));
  seq->push_back(Tanh());
  seq->push_back(OutProj(tied));
  Linear last(5, 5);
  last->to(device);
  seq->push_back(last);
  return seq;
}

// One process: the model trained on the whole batch for kSteps AdamW steps,
// step `skipped` left out (-1: none).
template <class Failing>
Named reference_skipping(const Batches& b, Where where, int skipped) {
  auto model = make_failing_model<Failing>(nullptr, {}, where, std::make_shared<bool>(false));
  init_parameters(*model, 7);
  auto opt = make_optimizer(Opt::AdamW, model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    if (s == skipped) continue;
    opt->zero_grad();
    torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    opt->step();
  }
  return parameters_of(*model);
}

// The model sharded over `comm`, its unit roots made with `options`,
// starting from reference_skipping's parameters.
template <class Failing>
FullyShard sharded_failing_model(const std::shared_ptr<Communicator>& comm,
                                 const FullyShardOptions& options, Where where,
                                 const std::shared_ptr<bool>& fail) {
  auto model = fully_shard(make_failing_model<Failing>(comm, options, where, fail), comm, options);
  auto twin = make_failing_model<Failing>(nullptr, {}, where, fail);
  init_parameters(*twin, 7);
  load_from(model, *twin);
  return model;
}

}  // namespace cohort::testing::fsdp_test
