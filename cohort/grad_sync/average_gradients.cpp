#include "cohort/grad_sync/average_gradients.h"

#include "cohort/comm/communicator.h"

namespace cohort {

void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm) {
  if (comm.size() == 1 || params.empty()) return;
  std::vector<torch::Tensor> grads;
  grads.reserve(params.size());
  for (auto p : params) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad());
  }
  comm.all_reduce_coalesced(grads, {ReduceOp::Avg}).wait();
}

}  // namespace cohort
