#include "cohort/grad_sync/accumulator_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace cohort {
namespace {

class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(const std::function<void(size_t, bool)>* ready, size_t index)
      : ready_(ready), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    // The engine runs an accumulator whose incoming gradient is undefined
    // (a checkpointed block's recompute that left the parameter out): it
    // leaves .grad as it was, so the parameter took no part.
    (*ready_)(index_, !inputs.empty() && inputs[0].defined());
    return outputs;
  }

 private:
  const std::function<void(size_t, bool)>* ready_;  // AccumulatorHooks' own, outlives the hook
  size_t index_;
};

}  // namespace

bool in_autograd_engine() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

AccumulatorHooks::AccumulatorHooks(const std::vector<torch::Tensor>& params,
                                   std::function<void(size_t, bool)> ready)
    : params_(params),
      ready_(std::move(ready)),
      accumulators_(params.size()),
      keys_(params.size()) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) hook(i);
  }
}

void AccumulatorHooks::hook(size_t i) {
  auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
  keys_[i] = acc->add_post_hook(std::make_unique<ReadyHook>(&ready_, i));
  accumulators_[i] = std::move(acc);
}

void AccumulatorHooks::refresh() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!accumulators_[i]) continue;
    auto current = torch::autograd::impl::try_get_grad_accumulator(params_[i]);
    if (current.get() == accumulators_[i].get()) continue;
    accumulators_[i]->del_post_hook(keys_[i]);
    hook(i);
  }
}

void AccumulatorHooks::hook_unhooked() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!accumulators_[i] && params_[i].requires_grad()) hook(i);
  }
}

AccumulatorHooks::~AccumulatorHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (accumulators_[i]) accumulators_[i]->del_post_hook(keys_[i]);
  }
}

}  // namespace cohort
