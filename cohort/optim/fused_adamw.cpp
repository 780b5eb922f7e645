#include "cohort/optim/fused_adamw.h"

#include <cmath>

namespace cohort {

void adamw_update(torch::Tensor& param, const torch::Tensor& grad, torch::Tensor& exp_avg,
                  torch::Tensor& exp_avg_sq, torch::Tensor& max_exp_avg_sq, int64_t step,
                  const torch::optim::AdamWOptions& options) {
  torch::NoGradGuard no_grad;
  const double lr = options.lr();
  if (options.weight_decay() != 0) param.mul_(1 - lr * options.weight_decay());
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  // Same double arithmetic as LibTorch (std::pow of the integer step).
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  torch::Tensor denom;
  if (options.amsgrad()) {
    torch::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
    denom = (max_exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  } else {
    denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  }
  const double step_size = lr / bias_correction1;
  param.addcdiv_(exp_avg, denom, -step_size);
}

}  // namespace cohort
