#include "cohort/grad_sync/average_gradients.h"

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort {

void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm) {
  if (comm.size() == 1 || params.empty()) return;
  // A frozen parameter never counts as having a gradient, so that it keeps
  // none; one that no rank has stays undefined, as in one process (an
  // optimizer's weight decay or momentum would step a defined zero).
  std::vector<char> local(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    local[i] = params[i].requires_grad() && params[i].grad().defined();
  }
  const auto has = any_rank_has(comm, local);
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!has[i]) continue;
    auto p = params[i];
    if (!p.requires_grad()) {
      // Frozen here, trained on another rank: this rank sends zeros and
      // keeps no gradient.
      grads.push_back(torch::zeros_like(p));
      continue;
    }
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  comm.all_reduce_coalesced(grads, {ReduceOp::Avg}).wait();
}

}  // namespace cohort
