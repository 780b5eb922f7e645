#include "cohort/core/once_differentiable.h"

#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "cohort/core/torch_compat.h"

namespace cohort {

torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads,
                                                   const std::string& what) {
  if (!torch::autograd::GradMode::is_enabled()) return grads;
  std::vector<size_t> defined;
  torch::autograd::variable_list wrapped;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    defined.push_back(i);
    // A leaf that requires grad, so that the error node becomes its history.
    wrapped.push_back(grads[i].detach().requires_grad_(true));
  }
  if (wrapped.empty()) return grads;
  auto error = make_node<torch::autograd::DelayedError>(
      "cohort: " + what +
          " is differentiable once: its gradient was computed outside autograd, so a second "
          "backward through it (create_graph=true) cannot be right",
      static_cast<int>(wrapped.size()));
  auto out = error->apply(std::move(wrapped));
  for (size_t k = 0; k < defined.size(); ++k) grads[defined[k]] = out[k];
  return grads;
}

}  // namespace cohort
