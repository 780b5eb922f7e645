#include "cohort/plan/grad_norm.h"

#include <cmath>

#include "cohort/comm/communicator.h"

namespace cohort {

double local_squared_norm(const std::vector<torch::Tensor>& params) {
  double sum = 0.0;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    sum += g.detach().to(torch::kFloat64).pow(2).sum().item<double>();
  }
  return sum;
}

double ReplicatedGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  return std::sqrt(local_squared_norm(params));
}

double ShardedGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  auto partial = torch::tensor({local_squared_norm(params)}, torch::kFloat64);
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
