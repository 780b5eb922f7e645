#include "cohort/plan/grad_norm.h"

#include <algorithm>
#include <cmath>

#include "cohort/comm/communicator.h"

namespace cohort {

double local_squared_norm(const std::vector<torch::Tensor>& params) {
  // The running sum stays on the gradients' device and is read once: an
  // item() per parameter would wait for a GPU once per parameter per step.
  // The additions are the same float64 additions in the same order as a
  // host loop would make, so the value does not depend on where it is summed.
  torch::NoGradGuard no_grad;
  torch::Tensor sum;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    auto square = g.detach().to(torch::kFloat64).pow(2).sum();
    sum = sum.defined() ? sum + square.to(sum.device()) : square;
  }
  return sum.defined() ? sum.item<double>() : 0.0;
}

double ReplicatedGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  return std::sqrt(local_squared_norm(params));
}

ShardedGradNorm::ShardedGradNorm(std::shared_ptr<Communicator> comm,
                                 const std::vector<torch::Tensor>& duplicates)
    : comm_(std::move(comm)) {
  for (const auto& t : duplicates) duplicates_.push_back(t.unsafeGetTensorImpl());
}

double ShardedGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> counted;
  for (const auto& p : params) {
    const void* impl = p.unsafeGetTensorImpl();
    if (std::find(duplicates_.begin(), duplicates_.end(), impl) == duplicates_.end())
      counted.push_back(p);
  }
  auto partial = torch::tensor({local_squared_norm(counted)}, torch::kFloat64);
  comm_->all_reduce(partial, {ReduceOp::Sum}).wait();
  return std::sqrt(partial.item<double>());
}

bool clip_grad_norm(const std::vector<torch::Tensor>& params, double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1.0)) return false;
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
  return true;
}

}  // namespace cohort
