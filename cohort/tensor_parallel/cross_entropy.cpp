// Vocab-parallel cross-entropy (Megatron-LM's _VocabParallelCrossEntropy):
// with z the logits of one token split over ranks by vocabulary,
//   loss = log(sum_j exp(z_j - m)) - (z_target - m),   m = max_j z_j,
// where m, z_target (held by one rank, zero elsewhere) and the sum of
// exponentials are each one all-reduce of one value per token. The gradient
// softmax(z) - onehot(target) needs only local columns, so backward sends
// nothing. A target equal to ignore_index has loss 0 and a zero gradient row.
// Half-precision logits are computed in float32, as Megatron-LM does: in
// bfloat16 the sum of V exponentials (and its all-reduce) keeps 8 bits, and
// in float16 it overflows past 65504 (V above that, with z = m for each);
// the loss and the gradient come back in the logits' dtype.
#include <torch/autograd.h>

#include "cohort/core/error.h"
#include "cohort/core/once_differentiable.h"
#include "cohort/tensor_parallel/layers.h"

namespace cohort::tensor_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// float32 for bfloat16 and float16 logits, else their own (float32, float64).
torch::ScalarType compute_type(const torch::Tensor& logits) {
  return at::promote_types(logits.scalar_type(), torch::kFloat);
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor target,
                               int64_t ignore_index, int64_t group_handle) {
    auto& g = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group_handle));
    const auto vocab = logits.size(-1);
    auto z = logits.reshape({-1, vocab}).to(compute_type(logits)).contiguous();
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
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    // In the compute dtype: the caller reduces it there before the cast.
    return (sum_exp.log() - predicted).masked_fill(ignored, 0.0).reshape(target.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    auto hit = saved[2].logical_not().to(grad.dtype());
    grad.scatter_add_(1, saved[1].unsqueeze(1), -hit.unsqueeze(1));
    grad.masked_fill_(saved[3].unsqueeze(1), 0.0);
    grad.mul_(grads[0].reshape({-1, 1}).to(grad.scalar_type()));
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    return once_differentiable({grad.reshape(ctx->saved_data["shape"].toIntVector()).to(dtype),
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
  // The loss comes back in the logits' dtype: an integer one would truncate it.
  if (!at::isFloatingType(logits.scalar_type())) {
    throw InvalidArgument(who + "logits must be floating point, not " +
                          std::string(c10::toString(logits.scalar_type())));
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
  // Reduced in the compute dtype, then cast to the logits' (as LibTorch's
  // cross_entropy returns it).
  const auto dtype = logits.scalar_type();
  switch (options.reduction) {
    case CrossEntropyReduction::None:
      return loss.to(dtype);
    case CrossEntropyReduction::Sum:
      return loss.sum().to(dtype);
    case CrossEntropyReduction::Mean:
      // Over the targets not ignored; 0 / 0 (all ignored) is NaN, as in LibTorch.
      return (loss.sum() / target.ne(options.ignore_index).sum()).to(dtype);
  }
  COHORT_CHECK(false, "unknown CrossEntropyReduction");
  return loss;
}

}  // namespace cohort::tensor_parallel
