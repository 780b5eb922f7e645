// Vocab-parallel cross-entropy (Megatron-LM's _VocabParallelCrossEntropy):
// with z the logits of one token split over ranks by vocabulary,
//   loss = log(sum_j exp(z_j - m)) - (z_target - m),   m = max_j z_j,
// where m, z_target (held by one rank, zero elsewhere) and the sum of
// exponentials are each one all-reduce of one value per token. The gradient
// softmax(z) - onehot(target) needs only local columns, so backward sends
// nothing.
#include <torch/autograd.h>

#include "cohort/core/error.h"
#include "cohort/tensor_parallel/layers.h"

namespace cohort::tensor_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor target,
                               int64_t group_handle) {
    auto& g = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group_handle));
    const auto vocab = logits.size(-1);
    auto z = logits.reshape({-1, vocab}).contiguous();
    auto t = target.reshape({-1});
    auto max = std::get<0>(z.max(1)).contiguous();
    if (g.size() > 1) {
      AllReduceOptions o;
      o.op = ReduceOp::Max;
      g.all_reduce(max, o).wait();
    }
    z = z - max.unsqueeze(1);

    const int64_t start = g.rank() * vocab;
    auto outside = (t < start).logical_or(t >= start + vocab);
    auto local_target = (t - start).masked_fill(outside, 0);
    auto predicted = z.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0);
    predicted = predicted.contiguous();
    if (g.size() > 1) g.all_reduce(predicted).wait();

    auto exp = z.exp();
    auto sum_exp = exp.sum(1).contiguous();
    if (g.size() > 1) g.all_reduce(sum_exp).wait();

    auto softmax = exp / sum_exp.unsqueeze(1);
    ctx->save_for_backward({softmax, local_target, outside});
    ctx->saved_data["shape"] = logits.sizes().vec();
    return (sum_exp.log() - predicted).reshape(target.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    auto hit = saved[2].logical_not().to(grad.dtype());
    grad.scatter_add_(1, saved[1].unsqueeze(1), -hit.unsqueeze(1));
    grad.mul_(grads[0].reshape({-1, 1}));
    return {grad.reshape(ctx->saved_data["shape"].toIntVector()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           Communicator& g) {
  if (logits.dim() < 1 || target.sizes() != logits.sizes().slice(0, logits.dim() - 1)) {
    throw InvalidArgument("cohort: vocab_parallel_cross_entropy (rank " + std::to_string(g.rank()) +
                          "): target must have the logits' shape " + "without the last dimension");
  }
  return VocabParallelCrossEntropy::apply(logits, target,
                                          static_cast<int64_t>(reinterpret_cast<intptr_t>(&g)));
}

}  // namespace cohort::tensor_parallel
