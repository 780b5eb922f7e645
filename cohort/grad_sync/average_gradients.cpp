#include "cohort/grad_sync/average_gradients.h"

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort {

void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm) {
  AllReduceOptions options;
  options.op = ReduceOp::Avg;
  reduce_gradients(params, comm, options);
}

namespace {

int64_t reduce(const std::vector<torch::Tensor>& params, Communicator& comm,
               const AllReduceOptions& options, const std::exception_ptr* failed,
               const std::string& where) {
  if (comm.size() == 1 || (params.empty() && !failed)) {
    if (failed && *failed) std::rethrow_exception(*failed);
    return 0;
  }
  // A frozen parameter never counts as having a gradient, so that it keeps
  // none; one that no rank has stays undefined, as in one process (an
  // optimizer's weight decay or momentum would step a defined zero).
  std::vector<char> local(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    local[i] = params[i].requires_grad() && params[i].grad().defined();
  }
  std::vector<char> has;
  if (!failed) {
    has = any_rank_has(comm, local);
  } else {
    try {
      has = any_rank_has_unless_failed(comm, local, *failed, where);
    } catch (...) {
      // Partial on the failed replica, and not averaged here: an optimizer
      // step after the exception must change nothing.
      for (const auto& p : params) p.mutable_grad() = torch::Tensor();
      throw;
    }
  }
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

}  // namespace

void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm,
                       const std::exception_ptr& failed, const std::string& where) {
  AllReduceOptions options;
  options.op = ReduceOp::Avg;
  reduce(params, comm, options, &failed, where);
}

int64_t reduce_gradients(const std::vector<torch::Tensor>& params, Communicator& comm,
                         const AllReduceOptions& options) {
  return reduce(params, comm, options, nullptr, "");
}

}  // namespace cohort
