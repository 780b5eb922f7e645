#include "cohort/train/gradient_sync.h"

#include <chrono>

#include "cohort/comm/communicator.h"

namespace cohort {

AllReduceGradientSync::AllReduceGradientSync(std::shared_ptr<Communicator> comm,
                                             std::vector<torch::Tensor> params)
    : comm_(std::move(comm)), params_(std::move(params)) {}

void AllReduceGradientSync::finish_sync() {
  if (comm_->size() == 1) return;
  std::vector<torch::Tensor> grads;
  for (auto& p : params_) {
    // A parameter unused on this rank still takes part, as zeros, so that
    // every rank sends the same tensors.
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad());
  }
  const auto start = std::chrono::steady_clock::now();
  comm_->all_reduce_coalesced(grads, {ReduceOp::Avg}).wait();
  comm_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace cohort
