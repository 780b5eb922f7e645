#include "cohort/grad_sync/average_gradients.h"

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort {

void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm) {
  AllReduceOptions options;
  options.op = ReduceOp::Avg;
  reduce_gradients(params, comm, options);
}

int64_t reduce_gradients(const std::vector<torch::Tensor>& params, Communicator& comm,
                         const AllReduceOptions& options) {
  if (comm.size() == 1 || params.empty()) return 0;
  // A frozen parameter never counts as having a gradient, so that it keeps
  // none; one that no rank has stays undefined, as in one process (an
  // optimizer's weight decay or momentum would step a defined zero).
  std::vector<char> local(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    local[i] = params[i].requires_grad() && params[i].grad().defined();
  }
  const auto has = any_rank_has(comm, local);
  std::vector<torch::Tensor> grads;
  int64_t bytes = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!has[i]) continue;
    auto p = params[i];
    bytes += static_cast<int64_t>(p.numel() * p.element_size());
    if (!p.requires_grad()) {
      // Frozen here, trained on another rank: this rank sends zeros and
      // keeps no gradient.
      grads.push_back(torch::zeros_like(p));
      continue;
    }
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad());
  }
  if (grads.empty()) return 0;
  comm.all_reduce_coalesced(grads, options).wait();
  return bytes;
}

}  // namespace cohort
