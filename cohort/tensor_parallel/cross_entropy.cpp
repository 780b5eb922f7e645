// Vocab-parallel cross-entropy (Megatron-LM's _VocabParallelCrossEntropy):
// with z the logits of one token split over ranks by vocabulary,
//   loss = log(sum_j exp(z_j - m)) - (z_target - m),   m = max_j z_j,
// where m, z_target (held by one rank, zero elsewhere) and the sum of
// exponentials are each one all-reduce of one value per token. The gradient
// softmax(z) - onehot(target) needs only local columns, so backward sends
// nothing. A target equal to ignore_index has loss 0 and a zero gradient row.
#include <torch/autograd.h>

#include "cohort/core/error.h"
#include "cohort/core/once_differentiable.h"
#include "cohort/tensor_parallel/layers.h"

namespace cohort::tensor_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor target,
                               int64_t ignore_index, int64_t group_handle) {
    auto& g = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group_handle));
    const auto vocab = logits.size(-1);
    auto z = logits.reshape({-1, vocab}).contiguous();
    auto t = target.reshape({-1});
    auto ignored = t.eq(ignore_index);
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
    ctx->save_for_backward({softmax, local_target, outside, ignored});
    ctx->saved_data["shape"] = logits.sizes().vec();
    return (sum_exp.log() - predicted).masked_fill(ignored, 0.0).reshape(target.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    auto hit = saved[2].logical_not().to(grad.dtype());
    grad.scatter_add_(1, saved[1].unsqueeze(1), -hit.unsqueeze(1));
    grad.masked_fill_(saved[3].unsqueeze(1), 0.0);
    grad.mul_(grads[0].reshape({-1, 1}));
    return once_differentiable({grad.reshape(ctx->saved_data["shape"].toIntVector()),
                                torch::Tensor(), torch::Tensor(), torch::Tensor()},
                               "vocab_parallel_cross_entropy");
  }
};

// Every TP rank holds the same targets, so each finds the same bad one here,
// before the first all-reduce: all ranks throw, none waits for the others.
void check_targets(const torch::Tensor& logits, const torch::Tensor& target, int64_t ignore_index,
                   const Communicator& g) {
  const std::string who = "cohort: vocab_parallel_cross_entropy (rank " + std::to_string(g.rank()) +
                          " of " + std::to_string(g.size()) + " in the TP group): ";
  if (logits.dim() < 1 || target.sizes() != logits.sizes().slice(0, logits.dim() - 1)) {
    throw InvalidArgument(who + "target must have the logits' shape without the last dimension");
  }
  if (target.scalar_type() != torch::kLong) {
    throw InvalidArgument(who + "target must be int64, not " +
                          std::string(c10::toString(target.scalar_type())));
  }
  const int64_t vocab = logits.size(-1) * g.size();
  auto t = target.reshape({-1});
  auto bad = t.ne(ignore_index).logical_and(t.lt(0).logical_or(t.ge(vocab)));
  if (!bad.any().item<bool>()) return;
  const int64_t i = bad.nonzero()[0][0].item<int64_t>();
  throw InvalidArgument(who + "target " + std::to_string(t[i].item<int64_t>()) + " at index " +
                        std::to_string(i) + " is outside [0, " + std::to_string(vocab) +
                        ") and is not ignore_index = " + std::to_string(ignore_index));
}

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           Communicator& g,
                                           const VocabParallelCrossEntropyOptions& options) {
  check_targets(logits, target, options.ignore_index, g);
  auto loss = VocabParallelCrossEntropy::apply(
      logits, target, options.ignore_index, static_cast<int64_t>(reinterpret_cast<intptr_t>(&g)));
  switch (options.reduction) {
    case CrossEntropyReduction::None:
      return loss;
    case CrossEntropyReduction::Sum:
      return loss.sum();
    case CrossEntropyReduction::Mean:
      // Over the targets not ignored; 0 / 0 (all ignored) is NaN, as in LibTorch.
      return loss.sum() / target.ne(options.ignore_index).sum();
  }
  COHORT_CHECK(false, "unknown CrossEntropyReduction");
  return loss;
}

}  // namespace cohort::tensor_parallel
